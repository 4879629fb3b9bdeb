"""Triton KV store: scatter the new tokens' K/V into their page slots.

Twin: `radixlm.kernels.reference.store_kv` (same signature and semantics: values are cast to the
cache dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.kernels.attention import (
    FLOAT_DTYPES,
    check_device,
    check_index,
    check_rows,
    next_pow2,
)


@triton.jit
def _store_kv_kernel(
    K,  # [T, H, D] new keys
    V,  # [T, H, D] new values
    K_buf,  # [S, H, D]
    V_buf,  # [S, H, D]
    Loc,  # [T] slot of each token
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    HEAD_DIM: tl.constexpr,
    NUM_COLS: tl.constexpr,  # H * HEAD_DIM
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program (token block, column block): columns enumerate (head, dim) pairs."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < num_tokens
    mask = mask_t[:, None] & (offs_c < NUM_COLS)[None, :]
    head = offs_c // HEAD_DIM
    dim = offs_c % HEAD_DIM
    slot = tl.load(Loc + offs_t, mask=mask_t, other=0).to(tl.int64)  # [BLOCK_T]
    rows = offs_t.to(tl.int64)
    k = tl.load(K + rows[:, None] * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
    v = tl.load(V + rows[:, None] * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
    k_dst = K_buf + slot[:, None] * stride_kbs + (head * stride_kbh + dim)[None, :]
    v_dst = V_buf + slot[:, None] * stride_vbs + (head * stride_vbh + dim)[None, :]
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def store_kv(
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    out_cache_loc: torch.Tensor,  # [T] int32/int64
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """Write `k[t]`, `v[t]` to slot `out_cache_loc[t]` of the buffers (cast to their dtype).

    Invariants (not checked: that would need a device sync): the slots are distinct (two tokens
    writing one slot race) and `< S`.
    """
    for name, t in (("k_buf", k_buf), ("v_buf", v_buf), ("k", k), ("v", v)):
        check_rows(name, t, 3, FLOAT_DTYPES)
    num_tokens = k.shape[0]
    check_index("out_cache_loc", out_cache_loc, num_tokens)
    if k_buf.shape != v_buf.shape or k.shape != v.shape or k.shape[1:] != k_buf.shape[1:]:
        raise ValueError(
            f"shape mismatch: k_buf {tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    check_device(k_buf, v_buf, out_cache_loc, k, v)
    if num_tokens == 0:
        return
    if k.dtype != k_buf.dtype or v.dtype != v_buf.dtype:
        # NOTE: a cast, which the runtime never needs (cache dtype == model dtype), is done by
        # torch: round-to-nearest-even everywhere (Triton's interpreter truncates to bf16).
        k, v = k.to(k_buf.dtype), v.to(v_buf.dtype)
    h, d = k.shape[1:]
    cols = h * d
    block_c = min(next_pow2(cols), 1024)
    block_t = max(1, min(next_pow2(num_tokens), 4096 // block_c, 16))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(cols, block_c))
    _store_kv_kernel[grid](
        k,
        v,
        k_buf,
        v_buf,
        out_cache_loc,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        HEAD_DIM=d,
        NUM_COLS=cols,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
    )
