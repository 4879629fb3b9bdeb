"""Constrained decoding end to end on the default model: what the grammar costs, what
jump-forward saves.

    .venv/bin/python benchmarks/bench_constrained.py [--threads 1] [--reps 3] [--batches 1,8,32]
        [--tokens 64] [--objects 16] [--dtype float32] [--out benchmarks/results/constrained.json]

Part 1, mask overhead: output tok/s of B requests (B = 1, 8, 32) decoding exactly ``--tokens``
tokens each, unconstrained (``ignore_eos``) vs constrained by a JSON schema (an array of small
objects with a ``minItems`` no output can reach within the limit) with each backend,
jump-forward off so that every token is sampled under the mask. Same prompts, same token
counts; one engine per backend, the unconstrained run on each; the median of ``--reps`` timed
runs after a warm-up (the compiled grammar is cached by then), the two kinds interleaved so
that load from other jobs on a shared box hits both alike. Reported: wall-clock tok/s, the
ratio by wall and by process CPU time (less sensitive to other jobs), and the share of the
constrained wall time spent in the grammar step (bitmask fill + apply, accept, jump-forward
check), measured inside the engine.

Part 2, jump-forward: completed JSON objects per second for ``--objects`` requests (a profile
schema with 8 required properties, greedy) submitted together and with at most 1 or 8 running
at a time, jump-forward on vs off (two engines; xgrammar, the default backend: the schema's
numeric bounds are beyond outlines). Every output must parse and validate. The outputs are not
the same text: with jump-forward the forced keys are spelled with the tokenizer's own tokens,
without it with whatever split the model picks under the mask, and what follows differs; so
output tok/s (sampled + forced tokens per second) is reported next to objects/s.

Timings are wall clock on whatever box runs this; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from radixlm import Engine, SamplingParams
from radixlm.runtime.models.loader import resolve_model_path

PEOPLE_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "city"],
    },
}
PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 16},
        "last_name": {"type": "string", "maxLength": 16},
        "email_address": {"type": "string", "maxLength": 32},
        "year_of_birth": {"type": "integer", "minimum": 1900, "maximum": 2025},
        "home_country": {"type": "string", "maxLength": 20},
        "favourite_color": {"enum": ["red", "green", "blue", "yellow"]},
        "is_subscribed_to_newsletter": {"type": "boolean"},
        "number_of_children": {"type": "integer", "minimum": 0, "maximum": 12},
    },
    "required": [
        "first_name", "last_name", "email_address", "year_of_birth", "home_country",
        "favourite_color", "is_subscribed_to_newsletter", "number_of_children",
    ],
    "additionalProperties": False,
}  # fmt: skip
TOPICS = [
    "sailors", "painters", "chemists", "gardeners", "pilots", "bakers", "poets", "farmers",
    "doctors", "tailors", "miners", "drummers", "judges", "nurses", "chefs", "coders",
]  # fmt: skip


def make_engine(args: argparse.Namespace, **kw: Any) -> Engine:
    kw = {"num_pages": 1024, "max_running_requests": 64, **kw}
    return Engine(str(resolve_model_path(None)), dtype=args.dtype, num_threads=args.threads, **kw)


def chat(engine: Engine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def grammar_seconds(engine: Engine) -> float:
    step = engine.scheduler.appender.grammar
    return step.seconds if step is not None else 0.0


def timed(engine: Engine, prompts: list[str], params: SamplingParams) -> dict[str, Any]:
    """One batch: wall and process-CPU seconds, grammar seconds, results."""
    engine.flush_cache()
    g0 = grammar_seconds(engine)
    t0, c0 = time.perf_counter(), time.process_time()
    results = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall": wall, "cpu": cpu, "grammar": grammar_seconds(engine) - g0, "results": results}


def summarize(runs: list[dict[str, Any]], units: float) -> dict[str, Any]:
    """Medians over the reps; ``units`` (tokens or objects) per run."""
    wall = statistics.median(r["wall"] for r in runs)
    cpu = statistics.median(r["cpu"] for r in runs)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "per_wall_s": units / wall,
        "per_cpu_s": units / cpu,
        "grammar_share": statistics.median(r["grammar"] / r["wall"] for r in runs),
    }


# ---- part 1 ------------------------------------------------------------------------------------


def bench_overhead(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    engine = make_engine(args, grammar_backend=backend, enable_jump_forward=False)
    out: dict[str, Any] = {}
    try:
        base = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, temperature=0.0)
        # minItems: each item is >= 8 tokens, so no output can be complete within the limit.
        people = {**PEOPLE_SCHEMA, "minItems": max(8, args.tokens // 8 + 1)}
        configs = {
            "unconstrained": SamplingParams(**base, ignore_eos=True),
            "constrained": SamplingParams(**base, constraint={"json_schema": people}),
        }
        for batch in args.batches:
            prompts = [
                chat(engine, f"List famous {TOPICS[i % len(TOPICS)]} (#{i}) as JSON.")
                for i in range(batch)
            ]
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
            for params in configs.values():
                timed(engine, prompts, params)  # warm-up (and grammar compile)
            for _ in range(args.reps):  # interleaved: load drift on a shared box hits both
                for label, params in configs.items():
                    run = timed(engine, prompts, params)
                    bad = [r for r in run["results"] if r.finish_reason != "length"]
                    assert not bad, [(r.finish_reason, r.error, r.text) for r in bad]
                    runs[label].append(run)
            tokens = batch * args.tokens
            row = {label: summarize(rs, tokens) for label, rs in runs.items()}
            row["ratio_wall"] = (
                row["constrained"]["per_wall_s"] / row["unconstrained"]["per_wall_s"]
            )
            row["ratio_cpu"] = row["constrained"]["per_cpu_s"] / row["unconstrained"]["per_cpu_s"]
            out[str(batch)] = row
            u, c = row["unconstrained"], row["constrained"]
            print(
                f"[{backend}] batch {batch:3d}: tok/s unconstrained {u['per_wall_s']:6.1f}, "
                f"constrained {c['per_wall_s']:6.1f} (ratio {row['ratio_wall']:.3f}; by CPU "
                f"time {row['ratio_cpu']:.3f}); grammar {100 * c['grammar_share']:.1f}% of the "
                "constrained wall time",
                flush=True,
            )
    finally:
        engine.shutdown()
    return out


# ---- part 2 ------------------------------------------------------------------------------------


def bench_jump_forward(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    params = SamplingParams(
        max_new_tokens=256, temperature=0.0, constraint={"json_schema": PROFILE_SCHEMA}
    )
    for running in (1, 8):
        engines = {
            jf: make_engine(args, enable_jump_forward=jf == "on", max_running_requests=running)
            for jf in ("on", "off")
        }
        try:
            prompts = [
                chat(engines["on"], f"Invent the profile of one of the {TOPICS[i % 16]} (#{i}).")
                for i in range(args.objects)
            ]
            runs: dict[str, list[dict[str, Any]]] = {k: [] for k in engines}
            stats: dict[str, dict[str, int]] = {}
            for engine in engines.values():
                timed(engine, prompts[:2], params)  # warm-up (and grammar compile)
            for _ in range(args.reps):
                for label, engine in engines.items():
                    s0 = engine.stats()
                    run = timed(engine, prompts, params)
                    s1 = engine.stats()
                    for r in run["results"]:
                        assert r.finish_reason == "stop", r.text
                        jsonschema.validate(json.loads(r.text), PROFILE_SCHEMA)
                    runs[label].append(run)
                    stats[label] = {
                        "forwards": s1.num_forwards - s0.num_forwards,
                        "output_tokens": sum(len(r.output_token_ids) for r in run["results"]),
                        "jump_forward_tokens": (
                            s1.num_jump_forward_tokens - s0.num_jump_forward_tokens
                        ),
                    }
        finally:
            for engine in engines.values():
                engine.shutdown()
        row: dict[str, Any] = {}
        for label, rs in runs.items():
            row[label] = {**summarize(rs, args.objects), **stats[label]}
            row[label]["output_tok_per_s"] = stats[label]["output_tokens"] / row[label]["wall_s"]
        on, off = row["on"], row["off"]
        row["ratio"] = on["per_wall_s"] / off["per_wall_s"]
        row["ratio_cpu"] = on["per_cpu_s"] / off["per_cpu_s"]
        row["tok_per_s_ratio"] = on["output_tok_per_s"] / off["output_tok_per_s"]
        out[str(running)] = row
        print(
            f"[jump-forward] running <= {running}: on {on['per_wall_s']:.2f} obj/s "
            f"({on['forwards']} forwards, {on['output_tokens']} tokens, "
            f"{on['jump_forward_tokens']} forced), off {off['per_wall_s']:.2f} obj/s "
            f"({off['forwards']} forwards, {off['output_tokens']} tokens); objects/s ratio "
            f"{row['ratio']:.2f} (CPU time {row['ratio_cpu']:.2f}), output tok/s ratio "
            f"{row['tok_per_s_ratio']:.2f}",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backends", default="xgrammar,outlines")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-jump-forward", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/constrained.json")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "threads": args.threads,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.date.today().isoformat(),
        },
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    out = Path(args.out)
    if out.exists():  # keep the part that was skipped this time
        old = json.loads(out.read_text())
        parts = ("overhead", "overhead_machine", "jump_forward", "jump_forward_machine")
        result = {**{k: v for k, v in old.items() if k in parts}, **result}

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

    if not args.skip_overhead:
        result["overhead"] = {b: bench_overhead(args, b) for b in args.backends.split(",")}
        result["overhead_machine"] = {**result["machine"], "args": result["args"]}
        write()
    if not args.skip_jump_forward:
        result["jump_forward"] = bench_jump_forward(args)
        result["jump_forward_machine"] = {**result["machine"], "args": result["args"]}
        write()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
