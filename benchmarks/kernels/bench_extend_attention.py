"""Extend (prefill) attention: the Triton paged kernel vs dense SDPA at equal tokens.

    .venv/bin/python benchmarks/kernels/bench_extend_attention.py            # needs CUDA
        [--cases 8x0+512,4x0+2048,8x1024+512,1x0+8192] [--q-heads 32] [--kv-heads 8]
        [--head-dim 128] [--page-size 16] [--dtype bfloat16] [--configs MxNwWsS,...]
        [--out PATH.json]
    .venv/bin/python benchmarks/kernels/bench_extend_attention.py --smoke    # CPU, interpreter

A case `BxP+E` is B requests, each with P cached prefix tokens (in pages) and E new tokens. The
Triton kernel reads the prefix through the page table and the new K/V from the forward's
tensors; the dense baseline is `torch.nn.functional.scaled_dot_product_attention` on
`[B, H, E, D]` queries over contiguous `[B, Hkv, P + E, D]` K/V (`enable_gqa`), causal
(`is_causal` when P == 0, which lets torch pick its flash kernel; an explicit mask otherwise).
Both see the same tokens; the dense one is spared the paging. Reported: median ms
(`triton.testing.do_bench`), TFLOP/s (4 * D flops per visible (query, key) pair per head), and
SDPA time / Triton time. Outputs are checked against each other before timing.

`--smoke` runs one tiny case in Triton's CPU interpreter to check that the script works; its
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default="8x0+512,4x0+2048,8x1024+512,1x0+8192")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--configs",
        default=None,
        help="comma list of kernel configs MxNwWsS (BLOCK_M x BLOCK_N, warps, stages) to time "
        "instead of the default `extend_blocks` choice, e.g. 64x64w4s1,128x64w8s2",
    )
    p.add_argument("--smoke", action="store_true", help="tiny case on CPU (interpreter)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def parse_case(text: str) -> tuple[int, int, int]:
    b, rest = text.split("x")
    prefix, new = rest.split("+")
    return int(b), int(prefix), int(new)


def parse_config(text: str) -> tuple[int, int, int, int]:
    """`MxNwWsS` -> (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    m, rest = text.split("x")
    n, rest = rest.split("w")
    w, s = rest.split("s")
    return int(m), int(n), int(w), int(s)


def bench(fn: Callable[[], object], cuda: bool) -> float:
    """Median milliseconds per call."""
    if cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_case(case: str, args: argparse.Namespace, cuda: bool) -> dict:
    """Check then time one `BxP+E` case; returns its row."""
    import torch
    import torch.nn.functional as F

    from radixlm.kernels.attention import page_table_indptr
    from radixlm.kernels.extend_attention import extend_attention
    from radixlm.kernels.forward_batch import ForwardBatch, KVCache

    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    hq, hkv, d, ps = args.q_heads, args.kv_heads, args.head_dim, args.page_size
    scale = d**-0.5
    b, prefix, new = parse_case(case)
    total = prefix + new
    torch.manual_seed(0)
    # Dense K/V of every position; the prefix part is also written into scattered pages.
    k_all = torch.randn(b, hkv, total, d, dtype=dtype, device=device)
    v_all = torch.randn(b, hkv, total, d, dtype=dtype, device=device)
    q_dense = torch.randn(b, hq, new, d, dtype=dtype, device=device)
    pages_per_seq = -(-total // ps)
    num_pages = b * pages_per_seq + 1
    cache = KVCache.allocate(1, num_pages, ps, hkv, d, dtype, device)
    perm = torch.randperm(num_pages)[: b * pages_per_seq].view(b, pages_per_seq)
    batch = ForwardBatch.build([[1] * new] * b, [prefix] * b, perm.tolist(), [[]] * b, ps, device)
    pos = torch.arange(prefix, device=device)
    table = batch.page_table.long()
    prefix_slots = table[:, pos // ps] * ps + pos % ps  # [b, prefix]
    cache.k_buffers[0][prefix_slots] = k_all[:, :, :prefix].transpose(1, 2)
    cache.v_buffers[0][prefix_slots] = v_all[:, :, :prefix].transpose(1, 2)
    q = q_dense.transpose(1, 2).reshape(b * new, hq, d).contiguous()  # [T, Hq, D]
    k_new = k_all[:, :, prefix:].transpose(1, 2).reshape(b * new, hkv, d).contiguous()
    v_new = v_all[:, :, prefix:].transpose(1, 2).reshape(b * new, hkv, d).contiguous()
    o = torch.empty_like(q)
    ids = torch.arange(b, dtype=torch.int32, device=device)
    kv_indptr = page_table_indptr(batch.page_table)
    kv_indices = batch.page_table.reshape(-1)

    def run_triton() -> torch.Tensor:
        return extend_attention(
            q, k_new, v_new, o, cache.k_buffers[0], cache.v_buffers[0], ids,
            batch.qo_indptr, batch.prefix_lens, kv_indptr, kv_indices, ps, scale, new,
        )  # fmt: skip

    mask = None
    if prefix:
        qpos = prefix + torch.arange(new, device=device)
        mask = torch.arange(total, device=device)[None, :] <= qpos[:, None]  # [new, total]

    def run_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_dense, k_all, v_all, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=True,
        )  # fmt: skip

    expected = run_sdpa().transpose(1, 2).reshape(b * new, hq, d)
    got = run_triton()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    pairs = b * (new * prefix + new * (new + 1) // 2)  # visible (query, key) pairs
    flops = 4 * d * hq * pairs
    ms_t, ms_s = bench(run_triton, cuda), bench(run_sdpa, cuda)
    return {
        "case": case,
        "triton_ms": ms_t,
        "sdpa_ms": ms_s,
        "triton_tflops": flops / (ms_t * 1e-3) / 1e12,
        "sdpa_tflops": flops / (ms_s * 1e-3) / 1e12,
    }


def main() -> None:
    args = parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit(
            "bench_extend_attention.py measures GPU kernels and needs CUDA; none is available "
            "here (use --smoke for a tiny CPU interpreter run that checks the script)"
        )
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        args.cases, args.q_heads, args.kv_heads = "2x5+18,1x0+7", 4, 2
        args.head_dim, args.page_size, args.dtype = 16, 4, "float32"

    hq, hkv, d, ps = args.q_heads, args.kv_heads, args.head_dim, args.page_size
    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    print(f"device: {name}   q_heads={hq} kv_heads={hkv} head_dim={d} page_size={ps} {args.dtype}")
    if not cuda:
        print("SMOKE RUN on CPU under TRITON_INTERPRET: timings are not GPU figures")
    results: dict = {"device": name, "dtype": args.dtype, "measured_on_gpu": cuda, "cases": []}
    configs = [None] if args.configs is None else args.configs.split(",")
    import radixlm.kernels.extend_attention as ext

    default_blocks = ext.extend_blocks
    for config in configs:
        if config is not None:
            blocks = parse_config(config)
            ext.extend_blocks = lambda head_dim, c=blocks: c
            print(f"config {config} (BLOCK_M x BLOCK_N, warps, stages)")
        for case in args.cases.split(","):
            row = bench_case(case, args, cuda)
            row["config"] = config or "default"
            results["cases"].append(row)
            ms_t, ms_s = row["triton_ms"], row["sdpa_ms"]
            print(
                f"{case:>12}: triton {ms_t:9.3f} ms ({row['triton_tflops']:6.1f} TFLOP/s)   "
                f"sdpa {ms_s:9.3f} ms ({row['sdpa_tflops']:6.1f} TFLOP/s)   "
                f"sdpa/triton {ms_s / ms_t:5.2f}x"
            )
        ext.extend_blocks = default_blocks
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
