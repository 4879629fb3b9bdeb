"""Frontend programs with the radix cache on vs off: programs/s and cache hit rate.

    .venv/bin/python benchmarks/bench_programs.py [--num-programs 16] [--dtype bfloat16]
        [--threads 2] [--max-tokens 16] [--out benchmarks/results/programs.json]

Workload: a multi-call program, few-shot branch-solve-merge. Every program starts with the same
few-shot prefix (~700 tokens), asks its own question, forks 2 branches that each generate, and
merges them with a final generation: 4 requests per program (the fork's prefix request, 2
branches, the merge), each prompt extending the previous one. `run_batch` runs all programs
concurrently (it first caches the constant prefix found by tracing).

The same programs run twice, each time on a fresh in-process `Runtime`: with
`enable_prefix_caching=True` and `False`. Greedy decoding; the count of identical answers on both
sides is reported (in bfloat16 a different batch composition can flip a near-tie).
A short warm-up run precedes each measurement, then the cache is flushed. Timings are of
whatever box runs this; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

import radixlm as sgl

FACTS = [
    ("What do bees make?", "Bees make honey from the nectar of flowers and store it in wax combs."),
    (
        "Why is the sky blue?",
        "Air scatters blue sunlight more than red light, so the sky looks blue.",
    ),
    (
        "What is a volcano?",
        "A volcano is an opening in the crust where molten rock, ash and gas escape.",
    ),
    (
        "How do plants eat?",
        "Plants make sugar from water and carbon dioxide using the energy of light.",
    ),
    (
        "What is a comet?",
        "A comet is a ball of ice and dust that grows a glowing tail near the sun.",
    ),
    (
        "Why do we sleep?",
        "Sleep lets the body repair itself and the brain store what it has learned.",
    ),
    (
        "What is rust?",
        "Rust is iron oxide, formed when iron reacts with oxygen and water over time.",
    ),
    (
        "How do birds fly?",
        "Wings push air down and back, and the air pushes the bird up and forward.",
    ),
    (
        "What is thunder?",
        "Thunder is the sound of air expanding fast when lightning heats it suddenly.",
    ),
    (
        "What is a fossil?",
        "A fossil is the preserved remains or trace of a living thing from long ago.",
    ),
    (
        "Why does ice float?",
        "Ice is less dense than liquid water because its molecules form an open lattice.",
    ),
    (
        "What is an echo?",
        "An echo is sound that bounces off a surface and returns to the listener.",
    ),
]
QUESTIONS = [
    "What is a rainbow?", "Why do cats purr?", "What is a glacier?", "How do magnets work?",
    "What is fog?", "Why do leaves fall?", "What is a tide?", "How do fish breathe?",
    "What is sand?", "Why is the sea salty?", "What is a desert?", "How do clouds form?",
    "What is a star?", "Why do we yawn?", "What is wind?", "How does soap clean?",
]  # fmt: skip
PREFIX = (
    "Answer each question in one clear sentence, the way a good science teacher would.\n\n"
    + "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in FACTS) * 2
)


@sgl.function
def branch_solve_merge(s, question: str, max_tokens: int = 16):
    s += PREFIX + "Question: " + question + "\n"
    forks = s.fork(2)
    forks += lambda i: (
        ("Short answer:", "Answer for a child:")[i]
        + sgl.gen("draft", max_tokens=max_tokens, stop="\n")
    )
    forks.join()
    s += "Drafts:" + "".join(f"\n-{d}" for d in s["draft"]) + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=max_tokens, stop="\n")


def run_side(args: argparse.Namespace, cache: bool) -> dict[str, Any]:
    rt = sgl.Runtime(
        dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=cache, seed=0
    )
    try:
        batch = [
            {"question": QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)),
             "max_tokens": args.max_tokens}
            for i in range(args.num_programs)
        ]  # fmt: skip
        branch_solve_merge.run_batch(batch[:2], backend=rt, temperature=0)  # warm-up
        rt.engine.wait_idle()
        rt.flush_cache()
        s0 = rt.stats()
        t0 = time.perf_counter()
        states = branch_solve_merge.run_batch(batch, backend=rt, temperature=0)
        wall = time.perf_counter() - t0
        rt.engine.wait_idle()
        s1 = rt.stats()
    finally:
        rt.shutdown()
    errors = [repr(s.error()) for s in states if s.error() is not None]
    prompt = s1["prompt_tokens"] - s0["prompt_tokens"]
    hits = s1["cache_hit_tokens"] - s0["cache_hit_tokens"]
    return {
        "cache": cache,
        "programs": len(states),
        "wall_s": wall,
        "programs_per_s": len(states) / wall,
        "prompt_tokens": prompt,
        "computed_prompt_tokens": s1["computed_prompt_tokens"] - s0["computed_prompt_tokens"],
        "cache_hit_tokens": hits,
        "hit_rate": hits / prompt if prompt else 0.0,
        "generated_tokens": s1["generated_tokens"] - s0["generated_tokens"],
        "errors": errors,
        "answers": [s["answer"] if s.error() is None else None for s in states],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-programs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/programs.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    on = run_side(args, cache=True)
    off = run_side(args, cache=False)
    same = sum(a == b for a, b in zip(on["answers"], off["answers"]))
    ratio = on["programs_per_s"] / off["programs_per_s"]
    print("| radix cache | programs/s | wall s | prompt tokens | computed | hit rate |")
    print("|---|---|---|---|---|---|")
    for r in (on, off):
        print(
            f"| {'on' if r['cache'] else 'off'} | {r['programs_per_s']:.3f} | {r['wall_s']:.1f} | "
            f"{r['prompt_tokens']} | {r['computed_prompt_tokens']} | {r['hit_rate']:.1%} |"
        )
    print(
        f"ratio (on / off): {ratio:.2f}x; identical final answers on both sides: "
        f"{same}/{len(on['answers'])} (bfloat16 numerics differ with batch composition)"
    )
    if on["errors"] or off["errors"]:
        print("errors:", on["errors"][:3], off["errors"][:3])
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "args": vars(args),
        "ratio": ratio,
        "identical_answers": same,
        "on": on,
        "off": off,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
