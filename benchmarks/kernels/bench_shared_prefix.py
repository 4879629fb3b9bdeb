"""Decode attention over a shared system prompt: shared-prefix items on vs off (CPU op), in
each KV layout (`flat`; `pairs16`, the bf16 layout of CPUs with AVX512_BF16).

    .venv/bin/python benchmarks/kernels/bench_shared_prefix.py [--threads 2] [--iters 15]
        [--layouts flat,pairs16] [--out benchmarks/results/shared_prefix_attention.json]

SmolLM2-135M shapes (9 query / 3 KV heads, head dim 64, bf16, pages of 16 scattered at random)
and all 30 layers' K/V buffers, so a step streams them from memory as a real decode step does.
B decode rows each with a context of L tokens, the first S of them on the same pages (a system
prompt after a radix hit). Timed: one forward's attention (`init_forward` + 30 layer calls),
median of `--iters` after 3 warm-ups, with `min_shared_tokens` 128 (on) and 0 (off), alternated.
Prints the CPU flags and the load average; asserts nothing on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from radixlm.kernels.forward_batch import ForwardBatch, KVCache
from radixlm.kernels.registry import create_attention_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from bench_peers import cpu_description  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 9, 3, 64, 16, 30
CASES = [(8, 1300, 1024), (32, 1100, 1024), (8, 300, 0), (32, 300, 0), (64, 512, 0)]  # (B, L, S)


def case_ms(b: int, ctx: int, shared: int, iters: int, layout: str = "flat") -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    pages_per_row = -(-ctx // PAGE)
    num_pages = b * pages_per_row + 8
    shape = (num_pages * PAGE, HKV, D)
    cache = KVCache(
        [torch.randn(shape, generator=gen).bfloat16() for _ in range(LAYERS)],
        [torch.randn(shape, generator=gen).bfloat16() for _ in range(LAYERS)],
        PAGE,
    ).as_layout(layout)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    common = perm[: shared // PAGE]
    nxt = len(common)
    page_lists = []
    for _ in range(b):
        own = pages_per_row - len(common)
        page_lists.append(common + perm[nxt : nxt + own])
        nxt += own
    batch = ForwardBatch.build([[1]] * b, [ctx - 1] * b, page_lists, [[0]] * b, PAGE, "cpu")
    q = torch.randn(b, HQ, D, generator=gen).bfloat16()
    k = torch.randn(b, HKV, D, generator=gen).bfloat16()
    times: dict[str, list[float]] = {"on": [], "off": []}
    backends = {}
    for mode in ("on", "off"):
        be = create_attention_backend("cpu", cache)
        be.min_shared_tokens = 128 if mode == "on" else 0
        backends[mode] = be

    def step(be) -> None:
        be.init_forward(batch)
        for layer in range(LAYERS):
            be.forward(layer, q, k, k, 0.125)

    for be in backends.values():
        for _ in range(3):
            step(be)
    for _ in range(iters):
        for mode, be in backends.items():
            t = time.perf_counter()
            step(be)
            times[mode].append((time.perf_counter() - t) * 1e3)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "layout": layout,
        "batch": b,
        "context": ctx,
        "shared": shared,
        "shared_items": backends["on"].plan.num_shared_items,
        "on_ms": on,
        "off_ms": off,
        "speedup": off / on,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--layouts", default="flat,pairs16", help="comma list of KV layouts")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"CPU: {cpu_description()}; threads {args.threads}; load average {load}")
    rows = []
    for b, ctx, shared in CASES:
        for layout in args.layouts.split(","):
            r = case_ms(b, ctx, shared, args.iters, layout)
            rows.append(r)
            print(
                f"{layout:>7} B={b:>2} ctx {ctx:>4} shared {shared:>4}: off {r['off_ms']:7.2f} ms, "
                f"on {r['on_ms']:7.2f} ms ({r['speedup']:.2f}x, {r['shared_items']} shared items)",
                flush=True,
            )
    print(f"load average at the end {os.getloadavg()}")
    if args.out:
        meta = {"cpu": cpu_description(), "threads": args.threads, "loadavg_start": load}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
