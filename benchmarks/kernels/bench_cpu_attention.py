"""CPU paged attention: the compiled op (backend "cpu") vs the torch twin ("torch"), per layer call.

    .venv/bin/python benchmarks/kernels/bench_cpu_attention.py [--threads 1,2] [--repeats 7]
        [--out benchmarks/results/cpu_attention.json]

SmolLM2-135M shapes: 9 query heads, 3 KV heads, head dim 64, bf16, pages of 16 tokens scattered at
random through the pool. Cases: decode at batch 1 / 8 / 32 / 64 with 512-token contexts and batch
1 with a 4k context; extend of one 512-token chunk with prefix 0 and 1024. Timed: one
`backend.forward` (store of the new K/V + attention, what a model layer calls) after one
`init_forward` (planned once per forward, timed separately). Each timing is the minimum over
`--repeats` rounds of the mean over enough calls to run ~0.2 s (the box is shared: the minimum
is the least disturbed). Outputs are checked against each other before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from radixlm.kernels.forward_batch import ForwardBatch, KVCache
from radixlm.kernels.registry import create_attention_backend

HQ, HKV, D, PAGE = 9, 3, 64, 16
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("decode b1 ctx512", [(511, 1)]),
    ("decode b8 ctx512", [(511, 1)] * 8),
    ("decode b32 ctx512", [(511, 1)] * 32),
    ("decode b64 ctx512", [(511, 1)] * 64),
    ("decode b1 ctx4096", [(4095, 1)]),
    ("extend 512 prefix0", [(0, 512)]),
    ("extend 512 prefix1024", [(1024, 512)]),
]


@dataclass
class Row:
    case: str
    threads: int
    torch_us: float
    cpu_us: float
    speedup: float
    plan_torch_us: float
    plan_cpu_us: float


def make_case(shapes: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """A one-layer paged cache with random K/V and a batch of (prefix, new) requests."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(p + n) // PAGE) for p, n in shapes) + 8
    cache = KVCache.allocate(1, num_pages, PAGE, HKV, D, dtype, "cpu")
    cache.k_buffers[0].copy_(torch.randn(cache.k_buffers[0].shape, generator=gen))
    cache.v_buffers[0].copy_(torch.randn(cache.v_buffers[0].shape, generator=gen))
    free = list(range(num_pages))
    rng.shuffle(free)
    pages = [[free.pop() for _ in range(-(-(p + n) // PAGE))] for p, n in shapes]
    batch = ForwardBatch.build(
        [[1] * n for _, n in shapes],
        [p for p, _ in shapes],
        pages,
        [[] for _ in shapes],
        PAGE,
        "cpu",
    )
    t = sum(n for _, n in shapes)
    q = torch.randn(t, HQ, D, generator=gen).to(dtype)
    k = torch.randn(t, HKV, D, generator=gen).to(dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(dtype)
    return cache, batch, q, k, v


def time_us(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    n = 0
    while time.perf_counter() - start < 0.05:
        fn()
        n += 1
    per = (time.perf_counter() - start) / n
    calls = max(1, int(0.2 / per))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def bench(name: str, shapes, threads: int, repeats: int, dtype: torch.dtype) -> Row:
    torch.set_num_threads(threads)
    cache, batch, q, k, v = make_case(shapes, dtype)
    backends = {b: create_attention_backend(b, cache) for b in ("torch", "cpu")}
    outs, fwd, plan = {}, {}, {}
    scale = D**-0.5
    for b, be in backends.items():
        plan[b] = time_us(lambda be=be: be.init_forward(batch), repeats)
        be.init_forward(batch)
        outs[b] = be.forward(0, q, k, v, scale)
    torch.testing.assert_close(outs["cpu"].float(), outs["torch"].float(), atol=3e-2, rtol=3e-2)
    for b, be in backends.items():
        fwd[b] = time_us(lambda be=be: be.forward(0, q, k, v, scale), repeats)
    row = Row(
        name,
        threads,
        fwd["torch"],
        fwd["cpu"],
        fwd["torch"] / fwd["cpu"],
        plan["torch"],
        plan["cpu"],
    )
    print(
        f"{name:24s} threads={threads}  torch {row.torch_us:9.1f} us  cpu {row.cpu_us:9.1f} us"
        f"  speedup {row.speedup:5.2f}x  (plan: torch {row.plan_torch_us:.0f} us,"
        f" cpu {row.plan_cpu_us:.0f} us)",
        flush=True,
    )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--cases", default=None, help="comma-separated substrings of case names")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    wanted = args.cases.split(",") if args.cases else None
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for name, shapes in CASES:
            if wanted and not any(w in name for w in wanted):
                continue
            rows.append(bench(name, shapes, threads, args.repeats, dtype))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PAGE},
            "dtype": args.dtype,
            "torch_version": torch.__version__,
            "note": "2-core box shared with other jobs; min over repeats",
            "load_average_after": os.getloadavg(),
            "rows": [asdict(r) for r in rows],
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
