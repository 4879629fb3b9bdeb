"""The CPU compiled forward of the default model (SmolLM2-135M) in each `--quantization` mode:
ms per `ModelRunner.forward` and the weights' resident size.

    .venv/bin/python benchmarks/kernels/bench_quant_forward.py [--threads 2] [--iters 20]
        [--modes none,int8,int4,gguf] [--lm-head int8] [--out benchmarks/results/quant_forward.json]

A mode suffixed `-torch` (`gguf-torch`, `int4-torch`) runs int4 and int8 (the LM head) through
torch's kernels instead of radixlm's `int4_g32_mm` / `int8_mm` (the same weights).

Cases (`bench_cpu_forward.CASES`): decode steps at batch 1 / 8 / 32 / 64 over 300- or 512-token
contexts, and a 512-token prefill; median of `--iters` after warm-up. Prints the load average and
CPU flags: run it on a quiet box.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_forward import CASES, cpu_flags, make_batch, time_forward  # noqa: E402
from bench_quant_linear import markdown_table  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lm-head", default="int8", help="the quantized modes' LM head: int8 | int4")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--modes", default="none,int8,int4,gguf")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner
    from radixlm.runtime.models.loader import resolve_model_path

    print(f"load average {os.getloadavg()}, CPU flags: {cpu_flags()}, threads {args.threads}")
    model_dir = resolve_model_path(None)
    results: dict[str, dict[str, float]] = {}
    from radixlm.runtime.quantization import kernels

    ours = kernels.int4_g32_supported, kernels.int8_rows_supported
    for mode in args.modes.split(","):
        if mode.endswith("-torch"):
            kernels.int4_g32_supported = kernels.int8_rows_supported = lambda: False
        try:
            runner = ModelRunner(
                model_dir, "bfloat16", torch.device("cpu"), CacheConfig(num_pages=4096),
                quantization=mode.removesuffix("-torch"), quantization_lm_head=args.lm_head,
            )  # fmt: skip
        finally:
            kernels.int4_g32_supported, kernels.int8_rows_supported = ours
        row = {"weight_mb": runner.weight_bytes / 1e6}
        for name, b, ctx, new in CASES:
            fb = make_batch(runner, b, ctx, new)
            row[f"{name} ms"] = time_forward(runner, fb, args.iters if new == 1 else 3)
        results[mode] = row
        print(mode, {k: round(v, 1) for k, v in row.items()}, flush=True)
        del runner
    print(markdown_table(results, "mode"))
    if args.out:
        meta = {"loadavg": os.getloadavg(), "cpu_flags": cpu_flags(), "threads": args.threads}
        args.out.write_text(json.dumps({"meta": meta, "modes": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
