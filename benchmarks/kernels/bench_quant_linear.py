"""SmolLM2's 120 per-layer linears (and its LM head) on CPU: bf16 prepacked (oneDNN) vs weight-only
int8 vs int4 (group 32 / 64), per row count, with the weights streamed from memory (30 distinct
layers, as one forward reads them).

    .venv/bin/python benchmarks/kernels/bench_quant_linear.py [--threads 2] [--iters 10]
        [--rows 1,8,64,512] [--kinds bf16,int4-g32,int4-g32-torch] [--out FILE.json]

The kernels are the ones the runtime packs (`radixlm.runtime.quantization`): int8 (per output
channel) radixlm's `int8_mm` and int4 radixlm's `int4_g32_mm` where they run (AVX512_BF16,
bf16); `-torch` forces torch's `aten._weight_int8pack_mm` / `aten._weight_int4pack_mm_for_cpu`
(asymmetric groups), bf16 `mkldnn._linear_pointwise` on a `_reorder_linear_weight` layout,
`bf16-packed` radixlm's packed bf16 kernel (`linear_bf16.cpp`); `fp32` oneDNN's fp32 GEMM on an
fp32 copy (what a CPU without native bf16 computes in), `fp32-packed` radixlm's packed kernel on
fp32 activations over the bf16 weight (AVX2 + FMA; the runtime sends it every row count);
`-deq`: the runtime's large-row path
(the weight dequantized for the call, then `F.linear`). The kinds alternate within each
iteration (an A/B in one run: a busy box slows them alike). Prints the CPU flags and the load
average; ms per 120 linears (median of `--iters`), the bytes of weights (and scales) one pass
reads and the effective GB/s.
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
    from radixlm.runtime.quantization import kernels, quantize_linear

    lin = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
    if kind.startswith("bf16"):
        return PackedLinear(lin, bf16_kernel=kind == "bf16-packed")
    if kind == "fp32":
        return PackedLinear(lin.float())
    if kind == "fp32-packed":
        m = PackedLinear(lin.float(), lowp=torch.bfloat16)
        m.bf16_max_rows = sys.maxsize  # the kernel at every row count
        return m
    base = kind.removesuffix("-deq").removesuffix("-torch")  # int4-g32-torch-deq
    mode, _, group = base.partition("-g")
    ours = kernels.int4_g32_supported, kernels.int8_rows_supported
    if "-torch" in kind:  # torch's int4 / int8 kernel for this module
        kernels.int4_g32_supported = kernels.int8_rows_supported = lambda: False
    try:
        q = quantize_linear(lin, mode, int(group or 0))
    finally:
        kernels.int4_g32_supported, kernels.int8_rows_supported = ours
    return Path_(q, dequantize=kind.endswith("-deq"))


def weight_bytes(m) -> int:
    """Bytes a pass over module `m` reads: its weight (and scales) in the layout it runs."""
    q = getattr(m, "q", None)
    if q is not None:
        return q.qweight.nbytes + q.scales.nbytes
    w = m.weight_bf16 if m.weight_bf16 is not None else m.packed
    if w.layout == torch.strided:
        return w.nbytes
    return m.in_features * m.out_features * (4 if w.dtype == torch.float32 else 2)


class Path_:
    """One of a `QuantLinear`'s two paths at any row count: the low-bit kernel, or (`dequantize`)
    the large-row path, a float copy of the weight made for the call and `F.linear`."""

    def __init__(self, q, dequantize: bool) -> None:
        self.q, self.in_features, self.dequantize = q, q.in_features, dequantize
        self.out_features = q.out_features

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
    torch.manual_seed(0)
    results: dict[str, dict[str, float]] = {k: {} for k in kinds}
    nbytes: dict[str, dict[str, int]] = {}
    with torch.inference_mode():
        mods = {k: [build(k, o, i) for _ in range(LAYERS) for o, i in SHAPES] for k in kinds}
        heads = {k: build(k, VOCAB, HIDDEN) for k in kinds}
        for k in kinds:
            nbytes[k] = {
                "layers": sum(weight_bytes(m) for m in mods[k]),
                "lm_head": weight_bytes(heads[k]),
            }
        for r in rows:
            xs = {i: torch.randn(r, i, dtype=torch.bfloat16) for _, i in SHAPES}
            xs32 = {i: x.float() for i, x in xs.items()}
            times: dict[str, dict[str, list[float]]] = {
                k: {"layers": [], "lm_head": []} for k in kinds
            }
            for it in range(args.iters + 2):  # 2 warm-up rounds; kinds alternate in each round
                for k in kinds:
                    x = xs32 if k.startswith("fp32") else xs
                    t = time.perf_counter()
                    for m in mods[k]:
                        m(x[m.in_features])
                    t1 = time.perf_counter()
                    heads[k](x[HIDDEN])
                    t2 = time.perf_counter()
                    if it >= 2:
                        times[k]["layers"].append(t1 - t)
                        times[k]["lm_head"].append(t2 - t1)
            for k in kinds:
                for part, ts in times[k].items():
                    ms = 1000 * statistics.median(ts)
                    results[k][f"{part} r{r}"] = ms
                    results[k][f"{part} r{r} GB/s"] = nbytes[k][part] / ms / 1e6
            print(
                f"rows {r}:", {k: round(results[k][f"layers r{r}"], 2) for k in kinds}, flush=True
            )
    print(
        "MB read per pass:",
        {k: {p: round(b / 1e6, 1) for p, b in v.items()} for k, v in nbytes.items()},
    )
    print(markdown_table(results, "kind"))
    if args.out:
        info = {"cpu_flags": cpu_flags(), "threads": args.threads, "load": os.getloadavg()}
        out = {"info": info, "ms": results, "bytes": nbytes}
        args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
