"""Paged decode attention: achieved HBM bandwidth of the Triton kernel (and the torch twin).

    .venv/bin/python benchmarks/kernels/bench_decode_attention.py            # needs CUDA
        [--batch 64] [--context 4096] [--q-heads 32] [--kv-heads 8] [--head-dim 128]
        [--page-size 16] [--dtype bfloat16] [--splits auto|N] [--peak-gbps GBPS]
        [--no-torch] [--out PATH.json]
    .venv/bin/python benchmarks/kernels/bench_decode_attention.py --smoke    # CPU, interpreter

Default shape: batch 64 x 4k context, GQA 8:1 (32 q heads / 8 KV heads), head dim 128, bf16,
pages of 16 tokens scattered at random through the pool. Bytes counted: every K and V element of
every sequence once, plus q, o and the page table (the minimum traffic), over the median kernel
time (`triton.testing.do_bench`); `%peak` divides by the device's HBM peak from a table of known
GPUs (`--peak-gbps` overrides; unknown devices print n/a). The output is checked against the
torch twin before timing.

`--smoke` runs a tiny shape in Triton's CPU interpreter to check that the script works; its
timings mean nothing and are labelled so. Without CUDA and without `--smoke` it exits with a
message (status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# HBM peak bandwidth, GB/s (vendor figures), matched against torch.cuda.get_device_name().
HBM_PEAK_GBPS = {
    "H200": 4800.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,  # SXM
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100": 1555.0,  # 40GB
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "RTX 4090": 1008.0,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--splits", default="auto", help="split-KV factor: auto (heuristic) or N")
    p.add_argument("--peak-gbps", type=float, default=None, help="HBM peak of this GPU, GB/s")
    p.add_argument("--no-torch", action="store_true", help="skip timing the torch twin")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU (interpreter)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def peak_gbps(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    for key, value in HBM_PEAK_GBPS.items():
        if key in name:
            return value
    return None


def bench(fn: Callable[[], object], cuda: bool) -> float:
    """Median milliseconds per call."""
    if cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    args = parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit(
            "bench_decode_attention.py measures GPU kernels and needs CUDA; none is available "
            "here (use --smoke for a tiny CPU interpreter run that checks the script)"
        )
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        args.batch, args.context, args.q_heads, args.kv_heads = 2, 40, 4, 2
        args.head_dim, args.page_size, args.dtype = 16, 4, "float32"

    from radixlm.kernels.attention import page_table_indptr
    from radixlm.kernels.decode_attention import decode_attention
    from radixlm.kernels.forward_batch import ForwardBatch, KVCache
    from radixlm.kernels.reference import TorchAttentionBackend
    from radixlm.kernels.triton_backend import choose_num_kv_splits

    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    b, ctx, hq, hkv, d, ps = (
        args.batch,
        args.context,
        args.q_heads,
        args.kv_heads,
        args.head_dim,
        args.page_size,
    )
    pages_per_seq = -(-ctx // ps)
    num_pages = b * pages_per_seq + 1
    torch.manual_seed(0)
    cache = KVCache.allocate(1, num_pages, ps, hkv, d, dtype, device)
    cache.k_buffers[0].normal_()
    cache.v_buffers[0].normal_()
    perm = torch.randperm(num_pages)[: b * pages_per_seq].view(b, pages_per_seq)
    batch = ForwardBatch.build(
        [[1]] * b, [ctx - 1] * b, perm.tolist(), [[0]] * b, ps, device
    )  # one decode token per request at position ctx - 1
    q = torch.randn(b, hq, d, dtype=dtype, device=device)
    o = torch.empty_like(q)
    if args.splits == "auto":
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
        splits = choose_num_kv_splits(b, hkv, ctx, sms)
    else:
        splits = int(args.splits)
    kv_indptr = page_table_indptr(batch.page_table)
    kv_indices = batch.page_table.reshape(-1)
    ids = torch.arange(b, dtype=torch.int32, device=device)
    scale = d**-0.5

    def run_triton() -> torch.Tensor:
        return decode_attention(
            q, cache.k_buffers[0], cache.v_buffers[0], o, ids, batch.qo_indptr[:-1],
            batch.seq_lens, kv_indptr, kv_indices, ps, scale, splits,
        )  # fmt: skip

    twin = TorchAttentionBackend(cache)
    twin.init_forward(batch)
    k_self = cache.k_buffers[0][batch.out_cache_loc].clone()  # store_kv rewrites the same values
    v_self = cache.v_buffers[0][batch.out_cache_loc].clone()

    def run_torch() -> torch.Tensor:
        return twin.forward(0, q, k_self, v_self, scale)

    expected = run_torch()
    got = run_triton()
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)

    elt = torch.empty((), dtype=dtype).element_size()
    bytes_moved = 2 * b * ctx * hkv * d * elt + 2 * b * hq * d * elt + b * pages_per_seq * 4
    name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    peak = peak_gbps(name, args.peak_gbps) if cuda else None
    results = {
        "device": name,
        "shape": dict(batch=b, context=ctx, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps),
        "dtype": args.dtype,
        "num_kv_splits": splits,
        "peak_gbps": peak,
        "measured_on_gpu": cuda,
    }
    rows = [("triton", run_triton)] + ([] if args.no_torch else [("torch twin", run_torch)])
    print(f"device: {name}   {results['shape']}  {args.dtype}  splits={splits}")
    if not cuda:
        print("SMOKE RUN on CPU under TRITON_INTERPRET: timings are not GPU figures")
    for label, fn in rows:
        ms = bench(fn, cuda)
        gbps = bytes_moved / (ms * 1e-3) / 1e9
        pct = f"{100 * gbps / peak:.1f}%" if peak else "n/a"
        print(f"{label:>11}: {ms:9.3f} ms   {gbps:8.1f} GB/s   {pct} of HBM peak")
        results[label] = {"ms": ms, "gbps": gbps, "pct_peak": gbps / peak if peak else None}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
