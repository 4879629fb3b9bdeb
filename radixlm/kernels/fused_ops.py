"""Small fused Triton ops: RMSNorm (optionally fused with the residual add) and RoPE.

Numerics follow `radixlm.runtime.models.llama` (and Hugging Face): RMSNorm normalizes in fp32,
casts to the input dtype, then multiplies by the weight in that dtype; the fused residual add
rounds `x + residual` to the input dtype before normalizing (the unfused model does the same).
RoPE is neox-style rotate-half with `[max_pos, D]` cos/sin tables (both halves equal). One
difference: RoPE is computed in fp32 and rounded once, the torch path rounds each product, so
half-precision results may differ by an ulp.

Twins: `radixlm.kernels.reference.rms_norm_ref` and `rope_ref`.
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
def _rms_norm_kernel(
    X,  # [T, H]
    Res,  # [T, H] residual (read, then overwritten with x + residual) when HAS_RESIDUAL
    W,  # [H]
    Y,  # [T, H]
    hidden,
    eps,
    stride_xt,
    stride_rt,
    stride_yt,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program per row; the whole row (BLOCK >= hidden) is one tile."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(X + row * stride_xt + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_rt + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Res + row * stride_rt + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / hidden
    normed = (h * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_yt + offs, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], updated in place to x + residual
) -> torch.Tensor:  # [T, H]
    """`weight * normalize(x)` or, with `residual`, `residual <- x + residual` then
    `weight * normalize(residual)` (one pass). Output dtype: `torch.result_type(x, weight)`,
    like `RMSNorm.forward`."""
    check_rows("x", x, 2, FLOAT_DTYPES)
    check_rows("weight", weight, 1, FLOAT_DTYPES)
    t, h = x.shape
    if weight.shape != (h,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {h}")
    if residual is not None:
        check_rows("residual", residual, 2, (x.dtype,))
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        check_device(x, weight, residual)
    else:
        check_device(x, weight)
    y = torch.empty((t, h), dtype=torch.result_type(x, weight), device=x.device)
    if t == 0:
        return y
    res = residual if residual is not None else x
    _rms_norm_kernel[(t,)](
        x,
        res,
        weight,
        y,
        h,
        eps,
        x.stride(0),
        res.stride(0),
        y.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=next_pow2(h),
    )
    return y


@triton.jit
def _rope_kernel(
    X,  # [T, H, D]
    Y,  # [T, H, D]
    Pos,  # [T]
    Cos,  # [P, D]
    Sin,  # [P, D]
    num_heads,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    stride_cp,
    stride_sp,
    HALF: tl.constexpr,  # D // 2
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Program per token: all its heads as one `[BLOCK_H, BLOCK_HALF]` tile per half."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    cos1 = tl.load(Cos + pos * stride_cp + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    cos2 = tl.load(Cos + pos * stride_cp + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin1 = tl.load(Sin + pos * stride_sp + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin2 = tl.load(Sin + pos * stride_sp + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    x_ptr = X + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    y2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    y_ptr = Y + t * stride_yt + offs_h[:, None] * stride_yh + offs_d[None, :]
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def _rope_one(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    t, h, d = x.shape
    y = torch.empty_like(x)
    if t == 0:
        return y
    _rope_kernel[(t,)](
        x,
        y,
        positions,
        cos,
        sin,
        h,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=d // 2,
        BLOCK_H=next_pow2(h),
        BLOCK_HALF=next_pow2(d // 2),
    )
    return y


def apply_rope(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [P, D] (fp32 tables of `RotaryEmbedding`)
    sin: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their positions (new tensors, same dtype). `positions < P` is not
    checked (device sync)."""
    check_rows("q", q, 3, FLOAT_DTYPES)
    check_rows("k", k, 3, FLOAT_DTYPES)
    check_rows("cos", cos, 2, FLOAT_DTYPES)
    check_rows("sin", sin, 2, FLOAT_DTYPES)
    check_index("positions", positions, q.shape[0])
    d = q.shape[2]
    if d % 2 or k.shape[0] != q.shape[0] or k.shape[2] != d:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if cos.shape != sin.shape or cos.shape[1] != d:
        raise ValueError(f"cos/sin tables {tuple(cos.shape)} do not match head dim {d}")
    check_device(positions, q, k, cos, sin)
    return _rope_one(q, positions, cos, sin), _rope_one(k, positions, cos, sin)
