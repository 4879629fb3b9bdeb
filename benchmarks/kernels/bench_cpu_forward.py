"""The CPU forward, eager (reference) vs compiled (oneDNN-prepacked linears + fused C++ layer ops),
on the real default model (SmolLM2-135M, bf16), and where a compiled step's time goes.

    .venv/bin/python benchmarks/kernels/bench_cpu_forward.py [--threads 2] [--iters 20]
        [--out benchmarks/results/cpu_forward.json]

Cases: decode steps at batch 1 / 8 / 32 / 64 over 300- or 512-token contexts (scattered pages),
and a 512-token prefill. For each: ms per `ModelRunner.forward` (median of `--iters`, after
warm-up), eager and compiled; for the compiled step a torch.profiler split into linears
(oneDNN), attention (the paged op), and everything else; and the engine's decode step (schedule,
forward, sampling, update, detokenize on the loop thread) at batch 1 / 8 / 32 against the bare
forward of the same batch. Prints the load average and CPU flags; run it on a quiet box.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

CASES = [  # (name, batch, context, new tokens per request)
    ("decode b1 ctx300", 1, 300, 1),
    ("decode b8 ctx300", 8, 300, 1),
    ("decode b32 ctx300", 32, 300, 1),
    ("decode b64 ctx512", 64, 512, 1),
    ("prefill 512", 1, 0, 512),
]


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                return " ".join(f for f in wanted if f in flags)
    except OSError:
        pass
    return platform.machine()


def make_batch(runner, batch: int, context: int, new: int):
    from radixlm.kernels.forward_batch import ForwardBatch

    ps = runner.page_size
    per = -(-(context + new) // ps)
    perm = torch.randperm(batch * per).tolist()  # scattered pages
    pages = [perm[i * per : (i + 1) * per] for i in range(batch)]
    ids = [[(7 * i + j) % 40000 + 5 for j in range(new)] for i in range(batch)]
    return ForwardBatch.build(ids, [context] * batch, pages, [[new - 1]] * batch, ps, "cpu")


def time_forward(runner, fb, iters: int) -> float:
    for _ in range(3):
        runner.forward(fb)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        runner.forward(fb)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def split(runner, fb) -> dict[str, float]:
    """ms per step in linears / attention / other ops, by torch.profiler self CPU time, taken on
    the Python layers over the same ops (inside the one-call stack the profiler sees one op)."""
    from torch.profiler import profile

    n = 5
    stack, runner.model.stack = runner.model.stack, None
    try:
        with profile() as prof:
            for _ in range(n):
                runner.forward(fb)
    finally:
        runner.model.stack = stack
    out = {"linears": 0.0, "attention": 0.0, "other ops": 0.0}
    total = 0.0
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1000 / n
        total += ms
        if "linear" in e.key or e.key in ("aten::mm", "aten::addmm"):
            out["linears"] += ms
        elif "paged_attention" in e.key:
            out["attention"] += ms
        else:
            out["other ops"] += ms
    out["profiled total"] = total
    return out


def engine_steps(threads: int, batches: list[int]) -> dict[int, dict[str, float]]:
    """ms per decode step inside the engine vs the bare forward of the same shapes."""
    from radixlm import Engine, SamplingParams

    out = {}
    engine = Engine(num_threads=threads, num_pages=8192)
    try:
        params = SamplingParams(max_new_tokens=64, temperature=0, ignore_eos=True)
        for b in batches:
            prompts = [[(i + 7 * j) % 40000 + 5 for i in range(300)] for j in range(b)]
            engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0))
            t = time.perf_counter()
            engine.generate(prompts, params)  # prompts cached: one 1-token extend, then decode
            out[b] = {"engine ms/step": 1000 * (time.perf_counter() - t) / 64}
    finally:
        engine.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_forward.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner
    from radixlm.runtime.models.loader import resolve_model_path

    print(f"load average {os.getloadavg()}, CPU flags: {cpu_flags()}, threads {args.threads}")
    model_dir = resolve_model_path(None)
    runners = {
        mode: ModelRunner(
            model_dir,
            "bfloat16",
            torch.device("cpu"),
            CacheConfig(num_pages=4096),
            enforce_eager=(mode == "eager"),
        )
        for mode in ("eager", "compiled")
    }
    rows = []
    for name, b, ctx, new in CASES:
        row: dict[str, object] = {"case": name}
        for mode, runner in runners.items():
            fb = make_batch(runner, b, ctx, new)
            row[f"{mode} ms"] = time_forward(runner, fb, args.iters if new == 1 else 5)
        row["speedup"] = row["eager ms"] / row["compiled ms"]
        row.update(split(runners["compiled"], make_batch(runners["compiled"], b, ctx, new)))
        rows.append(row)
        print(
            f"{name:18s} eager {row['eager ms']:7.1f} ms  compiled {row['compiled ms']:7.1f} ms"
            f"  ({row['speedup']:.2f}x)  linears {row['linears']:.1f}  attention "
            f"{row['attention']:.1f}  other {row['other ops']:.1f} ms (profiled)",
            flush=True,
        )
    del runners
    eng = engine_steps(args.threads, [1, 8, 32])
    for b, r in eng.items():
        bare = next(x for x in rows if x["case"] == f"decode b{b} ctx300")["compiled ms"]
        r["bare forward ms"] = bare
        print(f"engine decode step b{b}: {r['engine ms/step']:.1f} ms (bare forward {bare:.1f})")
    record = {
        "meta": {
            "loadavg": os.getloadavg(),
            "cpu_flags": cpu_flags(),
            "threads": args.threads,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "cases": rows,
        "engine": {str(k): v for k, v in eng.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
