"""Speculative decoding against plain decoding, in process, on the default model: prompt lookup
+ radix tree drafts (`ngram`), a draft model (`draft`: by default the model itself with int4
weights, self-speculation), and optionally vLLM's CPU build with its n-gram speculation.

    .venv/bin/python benchmarks/bench_speculative.py [--threads 2] [--tokens 128]
        [--batches 1,8] [--modes plain,ngram,draft] [--reps 3] [--rounds 1]
        [--workloads extract,edit,quote,free,repeat,agent,agent-json] [--agent-turns 4]
        [--draft-tokens 4] [--draft-model default] [--draft-quantization int4]
        [--disable-by-batch-size N] [--vllm [--vllm-modes vllm,vllm-ngram]]
        [--step-cost [--step-cost-context 160] [--step-cost-reps 9]]
        [--out benchmarks/results/speculative.json]

Workloads, greedy, chat template, `--tokens` new tokens at most per generation:
- `extract`: JSON extraction from a short document into a schema (constrained decoding): the
  values are copied from the document;
- `edit`: a code edit: "return this function with one change": nearly all of it is copied;
- `edit-long`: the same over a ~2.3k-token module (not in the default list: its prefill is long);
- `quote`: answers that quote their source (copy a passage, fix one field of a JSON record);
- `free`: open questions whose answers quote nothing: drafts are rare, this shows the cost;
- `repeat`: the `free` prompts, each timed run after an untimed identical one (an agent loop or
  a program run again: the radix tree holds the whole earlier output);
- `agent`: a multi-turn agent loop through the DSL (`Runtime(engine=...)`): each turn the model
  writes one JSON tool call, Python answers it, `--agent-turns` turns; the calls repeat their
  structure and arguments;
- `agent-json`: the same loop with each call constrained by a tool-call JSON schema
  (`TOOL_CALL_SCHEMA`): jump-forward writes the keys, and the forward that computes them also
  verifies a draft of what follows (the earlier calls' tool names and paths).

Modes run one after the other, each with its own engine, one alive at a time (two engines in one
process slowed each other by ~25% on a 2-core CPU: libgomp's spin throttling, README); `--rounds
R` repeats that R times (plain, ngram, plain, ngram, ...: a fresh engine each round, `--reps`
timed runs each), so that a box whose speed drifts over minutes slows both modes alike instead
of the one that ran later. The radix cache is flushed before every timed run (drafts come from
the prompt, the run's own output and, for `repeat`, the untimed run). Per workload, batch size B
(B programs / requests at once) and mode: output tok/s (generated tokens over wall time; the
median of `--reps` runs after a warm-up), its ratio to `plain`, the load-independent counts of
the timed runs (`spec_stats`: forwards per run, tokens and rows per forward, acceptance rate,
mean accepted length, drafted / accepted tokens, the share of decoding steps that drafted,
tokens per verification; all runs of all rounds), and how many outputs are token-identical to
`plain`'s (greedy: all, up to bf16 rounding between a decode row and a verification row).
`--vllm` adds `vllm-ngram` (and `vllm` without drafts, for its own ratio): vLLM's CPU server
(`benchmarks/peers/bench_peers.py` starts it) with `--speculative-config '{"method": "ngram",
...}'`, on the unconstrained prompt workloads (`edit`, `quote`, `free`), each request over
`/v1/completions`. `--step-cost` first times a verification forward (B x (k + 1) rows) against a
plain decode step (B rows) on the `plain` engine, alternating (`step_costs`).
Prints the CPU and the load average; nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import radixlm as sgl
from radixlm import Engine, SamplingParams
from radixlm.lang.backend.runtime import Runtime

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from bench_peers import (  # noqa: E402
    SERVED_NAME,
    ServerSpec,
    cpu_description,
    ensure_vllm_venv,
    running_server,
    vllm_spec,
)

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
    f"Summarize this text, quoting its key sentences exactly:\n\n{PASSAGE}",
]
FREE = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue in three sentences.",
    "Give me three ideas for a birthday party.",
    "What are the benefits of regular exercise?",
]
FUNCTION = '''def summarize_orders(orders, currency="EUR"):
    """Total, count and mean of the paid orders in one currency."""
    total = 0.0
    count = 0
    for order in orders:
        if order["status"] != "paid":
            continue
        if order["currency"] != currency:
            continue
        total += order["amount"]
        count += 1
    mean = total / count if count else 0.0
    return {"total": round(total, 2), "count": count, "mean": round(mean, 2)}
'''
EDIT = [
    f"Return this function with the variable `total` renamed to `paid_total`. Output only the "
    f"code.\n\n{FUNCTION}",
    f'Return this function with the default currency changed to "USD". Output only the '
    f"code.\n\n{FUNCTION}",
    f"Return this function with a type hint `-> dict` added to its signature. Output only the "
    f"code.\n\n{FUNCTION}",
    f"Return this function with the rounding changed to 3 digits. Output only the "
    f"code.\n\n{FUNCTION}",
]
# ~2.3k tokens of code: an edit of a long file (a verification's keys are long enough to cut)
MODULE = "\n\n".join(
    f'def rate_{i}(amount, days):\n    """Fee {i} for an amount held `days` days."""\n'
    f"    if days <= {i % 7 + 1}:\n        return 0.0\n"
    f"    return round(amount * {(i * 37) % 90 + 10} / 10000 * days, 2)"
    for i in range(36)
)
EDIT_LONG = [
    f"Return this module with the function `rate_{i}` renamed to `fee_{i}`. Output only the "
    f"code.\n\n{MODULE}"
    for i in (3, 11, 19, 27)
]
DOCS = [
    "Grace Hopper was born in 1906 in New York City. She worked as a computer scientist and "
    "naval officer; write to her at grace.hopper@navy.example.",
    "Alan Turing was born in 1912 in London. He worked as a mathematician and cryptanalyst; "
    "write to him at alan.turing@bletchley.example.",
    "Katherine Johnson was born in 1918 in White Sulphur Springs. She worked as a mathematician "
    "at NASA; write to her at katherine.johnson@nasa.example.",
    "Edsger Dijkstra was born in 1930 in Rotterdam. He worked as a computer scientist and "
    "professor; write to him at edsger.dijkstra@utexas.example.",
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "email": {"type": "string"},
    },
    "required": ["name", "born", "city", "occupation", "email"],
    "additionalProperties": False,
}
EXTRACT = [
    f"Extract the person in this document as JSON with the keys name, born, city, occupation "
    f"and email, copying the values from the text.\n\n{doc}"
    for doc in DOCS
]
AGENT_SYSTEM = (
    "You are a coding agent. Tools: read_file(path), grep(pattern, path), run_tests(path). "
    'Reply with exactly one tool call per turn as JSON on one line, like {"tool": "grep", '
    '"args": {"pattern": "def main", "path": "src/app.py"}}.'
)
AGENT_TASKS = [
    "Find where the function parse_config is defined in src/config.py and check its tests.",
    "Find every use of the function load_user in src/users.py and run the tests of that file.",
    "Check whether src/server.py defines a function called handle_request and test it.",
    "Locate the class Cache in src/cache.py, read it, and run its tests.",
]
TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["read_file", "grep", "run_tests"]},
        "args": {
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
            "required": ["path"],
            "additionalProperties": False,
        },
    },
    "required": ["tool", "args"],
    "additionalProperties": False,
}
AGENT_WORKLOADS = ("agent", "agent-json")
PROMPT_WORKLOADS = {
    "extract": EXTRACT,
    "edit": EDIT,
    "edit-long": EDIT_LONG,
    "quote": QUOTE,
    "free": FREE,
}
VLLM_WORKLOADS = ("edit", "quote", "free")
ENGINE_MODES = ("plain", "ngram", "draft")


def tool_result(turn: int, call: str) -> str:
    """A deterministic tool answer that echoes the call (what a real tool's output repeats)."""
    try:
        args = json.loads(call).get("args", {})
    except (ValueError, AttributeError):
        args = {}
    path = args.get("path", "src/app.py") if isinstance(args, dict) else "src/app.py"
    return json.dumps(
        {"path": path, "turn": turn, "matches": [f"{path}:{10 * (turn + 1)}: def parse_config"]}
    )


@sgl.function
def agent_loop(s, task: str, turns: int, max_tokens: int, schema: dict[str, Any] | None = None):
    s += sgl.system(AGENT_SYSTEM)
    s += sgl.user(task)
    for i in range(turns):
        with s.assistant():
            s += sgl.gen(f"call{i}", max_tokens=max_tokens, stop="\n", json_schema=schema)
        s += sgl.user("Tool result: " + tool_result(i, s[f"call{i}"]))


def make_engine(args: argparse.Namespace, mode: str) -> Engine:
    """The engine of one mode (`plain`, `ngram`, `draft`)."""
    common: dict[str, Any] = dict(
        dtype=args.dtype,
        num_threads=args.threads,
        device=args.device,
        attention_backend=args.attention_backend,
        max_running_requests=max(16, *args.batch_sizes),  # a batch of B runs at once
    )
    spec: dict[str, Any] = dict(speculative_num_draft_tokens=args.draft_tokens)  # None: default
    if args.disable_by_batch_size is not None:
        spec["speculative_disable_by_batch_size"] = args.disable_by_batch_size
    kwargs = {
        "plain": {},
        "ngram": dict(spec, speculative_algorithm="ngram"),
        "draft": dict(
            spec,
            speculative_algorithm="draft",
            speculative_draft_model=args.draft_model,
            speculative_draft_quantization=args.draft_quantization,
        ),
    }
    return Engine(**common, **kwargs[mode])


def prompt_runner(
    eng: Engine, name: str, texts: list[str], b: int, tokens: int
) -> Callable[[], list[list[int]]]:
    """One timed run of a prompt workload: B requests at once; their output ids."""
    prompts = [eng.apply_chat_template([{"role": "user", "content": t}]) for t in (texts * b)[:b]]
    constraint = {"json_schema": SCHEMA} if name == "extract" else None
    params = SamplingParams(max_new_tokens=tokens, temperature=0, constraint=constraint)

    def go() -> list[list[int]]:
        return [r.outputs[0].output_token_ids for r in eng.generate(prompts, params)]

    return go


def agent_runner(
    eng: Engine, b: int, turns: int, tokens: int, schema: dict[str, Any] | None = None
) -> Callable[[], list[list[int]]]:
    backend = Runtime(engine=eng)
    kwargs = [
        {"task": t, "turns": turns, "max_tokens": tokens, "schema": schema}
        for t in (AGENT_TASKS * b)[:b]
    ]

    def go() -> list[list[int]]:
        states = agent_loop.run_batch(kwargs, backend=backend, temperature=0, num_threads=b)
        return [[hash(s.text())] for s in states]  # compare whole transcripts

    return go


@dataclass
class Runs:
    """The timed runs of one (workload, batch, mode), across rounds."""

    speeds: list[float] = field(default_factory=list)  # output tok/s of each run
    totals: Counter[str] = field(default_factory=Counter)  # `COUNTERS` summed over the runs
    outs: list[list[int]] = field(default_factory=list)  # the last run's outputs

    def summary(self) -> dict[str, Any]:
        """The median tok/s and `spec_stats` of all runs."""
        return {
            "tok_s": round(statistics.median(self.speeds), 1),
            **spec_stats(self.totals, len(self.speeds)),
        }


def measure(
    eng: Engine, go: Callable[[], list[list[int]]], reps: int, repeat: bool, runs: Runs
) -> None:
    """`reps` timed runs (after a warm-up) added to `runs`: their tok/s, their counters (the
    timed runs only) and the last run's outputs."""
    go()  # warm-up (oneDNN primitives for these shapes, grammar compiles)
    for _ in range(reps):
        # NOTE: an empty radix cache each time: otherwise the tree holds the previous run's
        # output and drafts all of it (the repeated-program case, `repeat`).
        eng.wait_idle()
        eng.flush_cache()
        if repeat:
            go()  # the earlier run, untimed
            eng.wait_idle()
        before = eng.stats()
        t = time.perf_counter()
        runs.outs = go()
        wall = time.perf_counter() - t
        eng.wait_idle()
        after = eng.stats()
        runs.speeds.append((after.generated_tokens - before.generated_tokens) / wall)
        for f in COUNTERS:
            runs.totals[f] += getattr(after, f) - getattr(before, f)


COUNTERS = (
    "num_forwards",
    "forward_tokens",
    "generated_tokens",
    "spec_decodes",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


def spec_stats(c: Counter[str], reps: int) -> dict[str, Any]:
    """The load-independent figures of the timed runs (`c`: `COUNTERS` summed over them):
    forwards per run, output tokens and rows (tokens computed) per forward; for drafting
    modes also the acceptance rate (accepted / drafted tokens), the mean accepted length per
    verified draft, drafted and accepted tokens per run, the share of decoding steps that
    verified a draft, and the tokens each verification emitted (accepted + 1)."""
    drafts, drafted = c["spec_drafts"], c["spec_draft_tokens"]
    accepted, forwards = c["spec_accepted_tokens"], c["num_forwards"]
    out: dict[str, Any] = {
        "forwards_per_run": round(forwards / reps, 1),
        "tokens_per_forward": round(c["generated_tokens"] / max(1, forwards), 2),
        "rows_per_forward": round(c["forward_tokens"] / max(1, forwards), 1),
    }
    if c["spec_decodes"]:
        out |= {
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "mean_accepted": round(accepted / drafts, 2) if drafts else None,
            "drafted_per_run": round(drafted / reps, 1),
            "accepted_per_run": round(accepted / reps, 1),
            "draft_step_share": round(drafts / c["spec_decodes"], 3),
            "tokens_per_verify": round(1 + accepted / drafts, 2) if drafts else None,
        }
    return out


async def _vllm_batch(url: str, prompts: list[str], tokens: int) -> tuple[int, list[str]]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt: str) -> dict[str, Any]:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": tokens,
                    "temperature": 0}  # fmt: skip
            r = await client.post(f"{url}/v1/completions", json=body)
            r.raise_for_status()
            return r.json()

        res = await asyncio.gather(*(one(p) for p in prompts))
    return sum(r["usage"]["completion_tokens"] for r in res), [r["choices"][0]["text"] for r in res]


def run_vllm(args: argparse.Namespace, tmpl: Engine, rows: list[dict[str, Any]]) -> None:
    """`vllm` and `vllm-ngram` rows: vLLM's CPU server without / with n-gram speculation."""
    from radixlm.runtime.models.loader import cache_dir, resolve_model_path

    venv = ensure_vllm_venv(args.vllm_venv)  # created on first use, as bench_peers does
    port = 18731
    ngram = {"method": "ngram", "num_speculative_tokens": args.draft_tokens,
             "prompt_lookup_max": 4, "prompt_lookup_min": 2}  # fmt: skip
    extras = {"vllm": [], "vllm-ngram": ["--speculative-config", json.dumps(ngram)]}
    for mode in args.vllm_modes:
        extra = extras[mode]
        base = vllm_spec(port, venv, resolve_model_path(None), args.threads, None, args.dtype)
        spec = ServerSpec(mode, [*base.cmd, *extra], base.env, base.ready_timeout_s)
        log = cache_dir() / "peers" / "logs" / f"speculative-{mode}.log"  # as bench_peers
        with running_server(spec, port, log) as url:
            for name in [w for w in args.workloads if w in VLLM_WORKLOADS]:
                for b in args.batch_sizes:
                    texts = (PROMPT_WORKLOADS[name] * b)[:b]
                    prompts = [
                        tmpl.apply_chat_template([{"role": "user", "content": t}]) for t in texts
                    ]
                    asyncio.run(_vllm_batch(url, prompts, 8))  # warm-up
                    speeds = []
                    for _ in range(args.reps):
                        t = time.perf_counter()
                        n, _ = asyncio.run(_vllm_batch(url, prompts, args.tokens))
                        speeds.append(n / (time.perf_counter() - t))
                    row = next(r for r in rows if r["workload"] == name and r["batch"] == b)
                    row[f"{mode}_tok_s"] = round(statistics.median(speeds), 1)
                    print(json.dumps({"workload": name, "batch": b, mode: row[f"{mode}_tok_s"]}))


def step_costs(eng: Engine, batches: list[int], context: int, reps: int) -> list[dict[str, Any]]:
    """What verifying drafts costs: the model forward of B requests of `context` cached tokens
    computing k + 1 rows each (k draft tokens, logits on every row, as a verification has),
    k in 0 / 1 / 2 / 4 (0: a plain decode step), the cases alternating round by round in one
    process, the median of `reps` rounds per case, and its ratio to k = 0 at the same B.
    Writes garbage K/V into free pages: the cache is flushed before and after."""
    from radixlm.kernels.forward_batch import ForwardBatch

    runner = eng.runner
    ps = runner.page_size
    eng.wait_idle()
    eng.flush_cache()
    cases = [(b, k) for b in batches for k in (0, 1, 2, 4)]

    def once(b: int, k: int) -> float:
        pages = -(-(context + k + 1) // ps)
        if b * pages > runner.num_pages:
            raise SystemExit(f"--step-cost needs {b * pages} pages, the engine has fewer")
        table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
        rows = list(range(b * (k + 1)))
        fb = ForwardBatch.from_parts(
            [100] * len(rows), [context] * b, [k + 1] * b, table, rows, ps, runner.device
        )
        t = time.perf_counter()
        runner.forward(fb)
        return time.perf_counter() - t

    for c in cases:  # warm-up: oneDNN primitives for each row count
        once(*c)
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    for _ in range(reps):
        for c in cases:
            times[c].append(once(*c))
    eng.flush_cache()
    med = {c: statistics.median(v) for c, v in times.items()}
    return [
        {"batch": b, "draft": k, "rows": b * (k + 1), "ms": round(1000 * med[(b, k)], 2),
         "vs_decode": round(med[(b, k)] / med[(b, 0)], 2)}
        for b, k in cases
    ]  # fmt: skip


def device_description(eng: Engine) -> str:
    """The device the engine runs on, its attention backend and whether decode graphs replay."""
    runner = eng.runner
    dev = runner.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    g = getattr(runner, "decode_graphs", None)
    graphs = "off" if g is None else (
        f"up to {g.max_bs} rows ({len(g.buckets)} buckets, captured in {g.capture_seconds:.1f} s)"
    )  # fmt: skip
    return f"{name} ({dev}), attention {runner.attention_backend_name}, cuda graphs {graphs}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from radixlm.runtime.models.loader import cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--modes", default="plain,ngram,draft")
    p.add_argument("--workloads", default="extract,edit,quote,free,repeat,agent,agent-json")
    p.add_argument("--agent-turns", type=int, default=4)
    p.add_argument(
        "--draft-tokens", type=int, default=None, help="default: the algorithm's (ngram 8, draft 4)"
    )
    p.add_argument("--draft-model", default="default")
    p.add_argument("--draft-quantization", default="int4")
    p.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="override the engine's default"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="modes alternated this many times")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None, help="default: the engine's (cuda if available)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--vllm", action="store_true", help="add vLLM's CPU server (--vllm-modes)")
    p.add_argument("--vllm-modes", default="vllm,vllm-ngram", help="vllm (no drafts), vllm-ngram")
    p.add_argument("--vllm-venv", type=Path, default=cache_dir() / "peers" / "vllm-venv")
    p.add_argument(
        "--step-cost",
        action="store_true",
        help="also time a verification forward (B x (k + 1) rows) against a decode step",
    )
    p.add_argument("--step-cost-context", type=int, default=160)
    p.add_argument("--step-cost-reps", type=int, default=9)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    args.workloads = args.workloads.split(",")
    args.batch_sizes = [int(x) for x in args.batches.split(",")]
    args.vllm_modes = args.vllm_modes.split(",")
    bad = (
        [m for m in args.modes if m not in ENGINE_MODES]
        + [m for m in args.vllm_modes if m not in ("vllm", "vllm-ngram")]
        + [w for w in args.workloads if w not in (*PROMPT_WORKLOADS, "repeat", *AGENT_WORKLOADS)]
    )
    if bad or "plain" not in args.modes:
        p.error(f"--modes needs plain (of {ENGINE_MODES}); unknown: {bad}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_description(), "| load average at start:", os.getloadavg())
    modes = [m for m in ENGINE_MODES if m in args.modes]
    cases = [(name, b) for name in args.workloads for b in args.batch_sizes]
    results: dict[tuple[str, int], dict[str, Any]] = {
        (name, b): {"workload": name, "batch": b} for name, b in cases
    }
    runs = {(c, mode): Runs() for c in cases for mode in modes}
    device: dict[str, str] = {}
    costs: list[dict[str, Any]] = []
    template: Engine | None = None
    # NOTE: one engine alive at a time. With two in one process both ran ~25% slower here
    # (SmolLM2 bf16, batch 8, 2 threads: 550 -> 407 tok/s for the first once the second was
    # built; one after the other, each as fast as alone): their forward teams hold more OpenMP
    # threads than the box has CPUs, and libgomp then barely spins between parallel regions.
    for rnd in range(args.rounds):
        for mode in modes:
            eng = make_engine(args, mode)
            try:
                device[mode] = device_description(eng)
                print(f"device (round {rnd + 1}):", mode, device[mode], flush=True)
                if mode == "plain":
                    template = eng  # its chat template (the tokenizer's) for vLLM's prompts
                    if args.step_cost and rnd == 0:
                        costs = step_costs(
                            eng, args.batch_sizes, args.step_cost_context, args.step_cost_reps
                        )
                        for c in costs:
                            print(json.dumps({"step_cost": c}), flush=True)
                for name, b in cases:
                    if name in AGENT_WORKLOADS:
                        schema = TOOL_CALL_SCHEMA if name == "agent-json" else None
                        go = agent_runner(eng, b, args.agent_turns, args.tokens, schema)
                    else:
                        texts = PROMPT_WORKLOADS["free" if name == "repeat" else name]
                        go = prompt_runner(eng, name, texts, b, args.tokens)
                    r = runs[((name, b), mode)]
                    measure(eng, go, args.reps, name == "repeat", r)
                    line = {"workload": name, "batch": b, "mode": mode, "round": rnd + 1}
                    print(json.dumps(line | r.summary()), flush=True)
            finally:
                eng.shutdown()
    for (case, mode), r in runs.items():
        results[case] |= {f"{mode}_{k}": v for k, v in r.summary().items()}
    rows: list[dict[str, Any]] = []
    for case in cases:
        res = results[case]
        for mode in modes:
            if mode != "plain":
                res[f"{mode}_ratio"] = round(res[f"{mode}_tok_s"] / res["plain_tok_s"], 2)
                plain, got = runs[(case, "plain")].outs, runs[(case, mode)].outs
                same = sum(a == s for a, s in zip(plain, got))
                res[f"{mode}_identical"] = f"{same}/{len(plain)}"
        rows.append(res)
        print(json.dumps(res), flush=True)
    if args.vllm:
        assert template is not None
        run_vllm(args, template, rows)
    print("load average at end:", os.getloadavg())
    out = {
        "cpu": cpu_description(),
        "device": device,
        "args": vars(args) | {"out": str(args.out)},
        "rows": rows,
        "step_cost": costs,
    }
    args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
