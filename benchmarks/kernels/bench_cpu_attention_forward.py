"""CPU decode attention inside the forward: the K/V read cold, as a model step reads them.

    .venv/bin/python benchmarks/kernels/bench_cpu_attention_forward.py [--threads 2]
        [--cases 8x460,32x400,64x512,1x2000] [--op-dir DIR] [--out PATH.json]

`bench_cpu_attention.py` times one layer's call repeated, its K/V in cache after the first
call; a forward reads each layer's K/V once, after the weights of the layers before it went
through the caches, i.e. from memory. Here: the real default model (SmolLM2-135M, bf16,
`pairs16` K/V), one decode row per request over `context` keys, and per case the forward's
median ms and the attention op's ms in it (torch.profiler self time of `paged_attention`, the
median of three profiles, taken on the Python layers over the same ops as
`bench_cpu_forward.py` does), with the K/V bytes over that time. Two page orders per case:
`scattered` (each request's pages a random sample of the pool) and `ascending` (each request's
pages one run in address order, as `BlockPool.alloc` hands out a fresh pool's).

`--op-dir DIR` loads the op built in DIR (`DIR/radixlm_cpu_ops.so`, e.g. another commit's build
from `~/.cache/radixlm/cpu_ops/<key>`) instead of this checkout's: an A/B of two kernels in one
session. Prints the load average and CPU flags; run it on a quiet box.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu_forward import cpu_flags, make_batch, split, time_forward  # noqa: E402

KV_BYTES_PER_TOKEN_LAYER = 2 * 3 * 64 * 2  # K and V, 3 KV heads x 64 dims, bf16


def ascending_batch(runner, batch: int, context: int, new: int):
    from radixlm.kernels.forward_batch import ForwardBatch

    ps = runner.page_size
    per = -(-(context + new) // ps)
    pages = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    ids = [[(7 * i + j) % 40000 + 5 for j in range(new)] for i in range(batch)]
    return ForwardBatch.build(ids, [context] * batch, pages, [[new - 1]] * batch, ps, "cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default="8x460,32x400,64x512,1x2000", help="BATCHxCONTEXT,...")
    p.add_argument("--op-dir", type=Path, default=None, help="load the op built in this dir")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.op_dir is not None:
        import radixlm.kernels.cpu.build as build

        so = args.op_dir / f"{build.NAME}.so"
        if not so.exists():
            sys.exit(f"no {so}")
        build.build_dir = lambda: args.op_dir  # `load_op` loads what is there
    torch.set_num_threads(args.threads)
    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner
    from radixlm.runtime.models.loader import resolve_model_path

    print(f"load average {os.getloadavg()}, CPU flags: {cpu_flags()}, threads {args.threads}")
    runner = ModelRunner(
        resolve_model_path(None), "bfloat16", torch.device("cpu"), CacheConfig(num_pages=8192)
    )
    layers = len(runner.model.layers)
    rows = []
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        for order, make in (("scattered", make_batch), ("ascending", ascending_batch)):
            fb = make(runner, batch, context, 1)
            forward_ms = time_forward(runner, fb, args.iters)
            attention_ms = statistics.median(split(runner, fb)["attention"] for _ in range(3))
            mb = batch * context * KV_BYTES_PER_TOKEN_LAYER * layers / 1e6
            row = {
                "batch": batch,
                "context": context,
                "pages": order,
                "forward ms": forward_ms,
                "attention ms": attention_ms,
                "kv MB": mb,
                "GB/s": mb / attention_ms,
            }
            rows.append(row)
            print(
                f"decode b{batch} x {context} keys, {order:9s} pages: forward {forward_ms:6.2f} ms,"
                f" attention {attention_ms:6.2f} ms ({mb:.0f} MB of K/V: {mb / attention_ms:.1f}"
                " GB/s)",
                flush=True,
            )
    if args.out is not None:
        meta = {"loadavg": os.getloadavg(), "cpu_flags": cpu_flags(), "threads": args.threads}
        meta["op_dir"] = str(args.op_dir) if args.op_dir else None
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
