"""Speculative decoding with prompt-lookup drafts (`--speculative-algorithm ngram`) against plain
decoding, in process, on the default model.

    .venv/bin/python benchmarks/bench_speculative.py [--threads 2] [--tokens 128]
        [--batches 1,8] [--draft-tokens 4] [--disable-by-batch-size N]
        [--out benchmarks/results/speculative.json]

Two workloads, greedy, chat template, `--tokens` new tokens at most:
- `quote`: the answer repeats spans of the prompt (copy a passage, fix one word in a JSON record,
  list a document's items): what agent loops and extraction do, where drafts are found;
- `free`: open questions whose answers quote nothing: drafts are rare, this shows the cost.

The radix cache is flushed before every timed run, so drafts come from prompt lookup only (a
repeated run would otherwise draft the whole earlier output from the tree). A third workload,
`repeat`, measures that case: the `free` prompts, each timed run after an untimed identical one
(an agent loop or a program run again).

Per workload and batch size (B requests submitted together): output tok/s plain and
speculative (the median of `--reps` runs after a warm-up), their ratio, the acceptance rate
(accepted / drafted tokens), and how many outputs are token-identical (greedy: they should all
be, up to bf16 rounding differences between a decode row and a verification row).
Prints the CPU (flags) and the load average; nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from radixlm import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from bench_peers import cpu_description  # noqa: E402

PASSAGE = (
    "The radix cache keeps every computed prefix in a tree of pages. When a request arrives, "
    "its longest cached prefix is reused and only the rest is computed. Pages are shared by "
    "reference count and evicted least recently used first."
)
RECORD = '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "city": "London"}'
QUOTE = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Here is a JSON record:\n{RECORD}\nReturn the same JSON record with the city changed to "
    "Paris. Output only JSON.",
    f"Copy this paragraph and then copy it again:\n\n{PASSAGE}",
    f"Rewrite this record as JSON with the same keys and values:\n{RECORD}",
]
FREE = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue in three sentences.",
    "Give me three ideas for a birthday party.",
    "What are the benefits of regular exercise?",
]


def run(engine: Engine, prompts: list[str], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_new_tokens=tokens, temperature=0)
    t = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - t
    outs = [r.outputs[0].output_token_ids for r in results]
    return sum(len(o) for o in outs) / wall, outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="override the engine's default"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_description(), "| load average at start:", os.getloadavg())
    common = dict(dtype=args.dtype, num_threads=args.threads, max_running_requests=16)
    engines = {
        "plain": Engine(**common),
        "spec": Engine(
            **common,
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=args.draft_tokens,
            **(
                {}
                if args.disable_by_batch_size is None
                else {"speculative_disable_by_batch_size": args.disable_by_batch_size}
            ),
        ),
    }
    rows: list[dict[str, Any]] = []
    try:
        for name, texts in (("quote", QUOTE), ("free", FREE), ("repeat", FREE)):
            for b in [int(x) for x in args.batches.split(",")]:
                prompts = [
                    engines["plain"].apply_chat_template([{"role": "user", "content": t}])
                    for t in (texts * b)[:b]
                ]
                res: dict[str, Any] = {"workload": name, "batch": b}
                outs: dict[str, list[list[int]]] = {}
                for key, eng in engines.items():
                    run(eng, prompts, 8)  # warm-up (oneDNN primitives for these shapes)
                    before = eng.stats()
                    speeds = []
                    for _ in range(args.reps):
                        # NOTE: an empty radix cache each time: otherwise the tree holds the
                        # previous run's output and drafts all of it (the repeated-program case).
                        eng.wait_idle()
                        eng.flush_cache()
                        if name == "repeat":
                            run(eng, prompts, args.tokens)  # the earlier run, untimed
                        speed, outs[key] = run(eng, prompts, args.tokens)
                        speeds.append(speed)
                    after = eng.stats()
                    res[f"{key}_tok_s"] = round(statistics.median(speeds), 1)
                    drafted = after.spec_draft_tokens - before.spec_draft_tokens
                    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
                    if key == "spec":
                        res["acceptance"] = round(accepted / drafted, 3) if drafted else None
                        res["accepted_per_step"] = round(
                            accepted / max(1, after.num_forwards - before.num_forwards), 2
                        )
                res["ratio"] = round(res["spec_tok_s"] / res["plain_tok_s"], 2)
                res["identical"] = sum(a == s for a, s in zip(outs["plain"], outs["spec"]))
                rows.append(res)
                print(json.dumps(res))
    finally:
        for eng in engines.values():
            eng.shutdown()
    print("load average at end:", os.getloadavg())
    out = {"cpu": cpu_description(), "args": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
