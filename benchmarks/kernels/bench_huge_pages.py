"""Transparent huge pages for the CPU's streamed memory (`kernels/host_memory.py`), A/B in one
process: the same data in a huge-page mapping (`zeros_huge`) and in ordinary 4 KB pages, the two
alternated every iteration (a busy or drifting box slows both alike).

    .venv/bin/python benchmarks/kernels/bench_huge_pages.py [--threads 2] [--iters 25]
        [--out benchmarks/results/huge_pages.json]

- `weights`: `ModelRunner.forward` decode steps of the real default model (SmolLM2-135M, bf16)
  at batch 1 / 4 / 8 / 32 over 300-token contexts, its packed bf16 weights in the runner's
  huge-page arena vs copies of them in ordinary memory (the KV pool is huge-page in both).
- `kv`: one decode step's attention (all 30 layers, SmolLM2 shapes, pairs16, pages scattered over
  a pool 4x the batch's need) over a KV pool in huge pages vs the same K/V in ordinary memory.

Prints the CPU flags, THP mode and load average; medians in ms; asserts nothing on timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_forward import cpu_flags, make_batch  # noqa: E402

HQ, HKV, D, PAGE, LAYERS = 9, 3, 64, 16, 30


def thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        return text.split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unavailable"


def ab(step_a, step_b, iters: int) -> tuple[float, float]:
    """Medians (ms) of `step_a` and `step_b`, alternated, after 2 warm-ups each."""
    for _ in range(2):
        step_a()
        step_b()
    ta, tb = [], []
    for _ in range(iters):
        for f, ts in ((step_a, ta), (step_b, tb)):
            t = time.perf_counter()
            f()
            ts.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ta), statistics.median(tb)


def weights_case(iters: int) -> list[dict[str, object]]:
    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner
    from radixlm.runtime.models.loader import resolve_model_path

    runner = ModelRunner(
        resolve_model_path(None), "bfloat16", torch.device("cpu"), CacheConfig(num_pages=4096)
    )
    stack, head = runner.model.stack, runner.model.lm_head
    huge = (list(stack.packed), head.weight_bf16)
    plain = ([w.clone() for w in huge[0]], huge[1].clone())

    def use(ws):
        stack.packed, head.weight_bf16 = ws

    rows = []
    for b in (1, 4, 8, 32):
        fb = make_batch(runner, b, 300, 1)

        def run(ws, fb=fb):
            use(ws)
            runner.forward(fb)

        h, p = ab(functools.partial(run, huge), functools.partial(run, plain), iters)
        rows.append({"case": f"decode b{b} ctx300", "huge ms": h, "plain ms": p})
        print(f"weights: decode b{b:<2d} huge {h:6.2f} ms  plain {p:6.2f} ms", flush=True)
    use(huge)
    return rows


def kv_case(iters: int) -> list[dict[str, object]]:
    from radixlm.kernels.forward_batch import ForwardBatch, KVCache
    from radixlm.kernels.host_memory import zeros_huge
    from radixlm.kernels.registry import create_attention_backend

    rows = []
    for b, ctx in ((8, 400), (32, 400), (64, 512)):
        gen = torch.Generator().manual_seed(0)
        per_row = -(-ctx // PAGE)
        num_pages = 4 * b * per_row + 8
        shape = (num_pages * PAGE, HKV, D)
        plain = KVCache(
            [torch.randn(shape, generator=gen).bfloat16() for _ in range(LAYERS)],
            [torch.randn(shape, generator=gen).bfloat16() for _ in range(LAYERS)],
            PAGE,
        ).as_layout("pairs16")

        def huge_copy(t: torch.Tensor) -> torch.Tensor:
            h = zeros_huge(tuple(t.shape), t.dtype)
            h.copy_(t)
            return h

        huge = KVCache(
            [huge_copy(t) for t in plain.k_buffers],
            [huge_copy(t) for t in plain.v_buffers],
            PAGE,
            layout=plain.layout,
        )
        perm = torch.randperm(num_pages, generator=gen).tolist()
        pages = [perm[i * per_row : (i + 1) * per_row] for i in range(b)]
        batch = ForwardBatch.build([[1]] * b, [ctx - 1] * b, pages, [[0]] * b, PAGE, "cpu")
        q = torch.randn(b, HQ, D, generator=gen).bfloat16()
        k = torch.randn(b, HKV, D, generator=gen).bfloat16()
        backends = []
        for cache in (huge, plain):
            be = create_attention_backend("cpu", cache)
            be.min_shared_tokens = 0
            backends.append(be)

        def step(be, batch=batch, q=q, k=k) -> None:
            be.init_forward(batch)
            for layer in range(LAYERS):
                be.forward(layer, q, k, k, 0.125)

        h, p = ab(functools.partial(step, backends[0]), functools.partial(step, backends[1]), iters)
        rows.append({"case": f"attention {b} x {ctx}", "huge ms": h, "plain ms": p})
        print(f"kv: attention {b} x {ctx}  huge {h:6.2f} ms  plain {p:6.2f} ms", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"load average {os.getloadavg()}, CPU flags: {cpu_flags()}, THP {thp_mode()}, "
        f"threads {args.threads}"
    )
    rows = weights_case(args.iters) + kv_case(args.iters)
    if args.out:
        meta = {"loadavg": os.getloadavg(), "cpu_flags": cpu_flags(), "thp": thp_mode()}
        args.out.write_text(json.dumps({"meta": meta, "cases": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
