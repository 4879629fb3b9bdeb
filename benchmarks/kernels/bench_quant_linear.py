"""SmolLM2's 120 per-layer linears (and its LM head) on CPU: bf16 prepacked (oneDNN) vs weight-only
int8 vs int4 (group 32 / 64), per row count, with the weights streamed from memory (30 distinct
layers, as one forward reads them).

    .venv/bin/python benchmarks/kernels/bench_quant_linear.py [--threads 2] [--iters 10]
        [--rows 1,8,64,512] [--out benchmarks/results/quant_linear.json]

The kernels are the ones the runtime packs (`radixlm.runtime.quantization`): int8 is
`aten._weight_int8pack_mm` (per output channel), int4 `aten._weight_int4pack_mm_for_cpu`
(asymmetric groups), bf16 `mkldnn._linear_pointwise` on a `_reorder_linear_weight` layout;
`-deq`: the runtime's large-row path (the weight dequantized for the call, then `F.linear`). Prints
the CPU flags and the load average (a busy box's figures are not the CPU's); ms per 120 linears
(median of `--iters`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

HIDDEN, INTER, Q, KV, LAYERS, VOCAB = 576, 1536, 576, 192, 30, 49152
SHAPES = [  # (out, in) of one layer's four projections
    (Q + 2 * KV, HIDDEN),
    (HIDDEN, Q),
    (2 * INTER, HIDDEN),
    (HIDDEN, INTER),
]


def cpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
            return " ".join(f for f in wanted if f in flags)
    return "unknown"


def build(kind: str, out_f: int, in_f: int):
    """A linear module of `kind` on a random bf16 weight."""
    from torch import nn

    from radixlm.runtime.models.cpu_linear import PackedLinear
    from radixlm.runtime.quantization import quantize_linear

    lin = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
    if kind == "bf16":
        return PackedLinear(lin)
    base = kind.removesuffix("-deq")
    mode, _, group = base.partition("-g")
    return Path_(quantize_linear(lin, mode, int(group or 0)), dequantize=kind != base)


class Path_:
    """One of a `QuantLinear`'s two paths at any row count: the low-bit kernel, or (`dequantize`)
    the large-row path, a float copy of the weight made for the call and `F.linear`."""

    def __init__(self, q, dequantize: bool) -> None:
        self.q, self.in_features, self.dequantize = q, q.in_features, dequantize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q
        if self.dequantize:
            return q.kernel.mm_dequantized(x, q.qweight, q.scales)
        return q.kernel.mm(x, q.qweight, q.scales)


def markdown_table(results: dict[str, dict[str, float]], first: str) -> str:
    """One row per key of `results`, one column per key of its rows."""
    cols = list(next(iter(results.values())))
    lines = [f"| {first} | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    return "\n".join(lines)


def time_ms(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rows", default="1,8,32,64,128,512")
    p.add_argument("--kinds", default="bf16,int8,int8-deq,int4-g32,int4-g64,int4-g32-deq")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    kinds = args.kinds.split(",")
    print(f"cpu flags: {cpu_flags()}; threads {args.threads}; load average {os.getloadavg()}")
    results: dict[str, dict[str, float]] = {}
    torch.manual_seed(0)
    with torch.inference_mode():
        for kind in kinds:
            layers = [build(kind, o, i) for _ in range(LAYERS) for o, i in SHAPES]
            head = build(kind, VOCAB, HIDDEN)
            results[kind] = {}
            for r in rows:
                xs = {i: torch.randn(r, i, dtype=torch.bfloat16) for _, i in SHAPES}

                def step(layers=layers, xs=xs) -> None:
                    for m in layers:
                        m(xs[m.in_features])

                results[kind][f"layers r{r}"] = time_ms(step, args.iters)
                x = xs[HIDDEN]
                results[kind][f"lm_head r{r}"] = time_ms(lambda x=x, h=head: h(x), args.iters)
            print(kind, {k: round(v, 2) for k, v in results[kind].items()}, flush=True)
    print(markdown_table(results, "kind"))
    if args.out:
        info = {"cpu_flags": cpu_flags(), "threads": args.threads, "load": os.getloadavg()}
        args.out.write_text(json.dumps({"info": info, "ms": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
