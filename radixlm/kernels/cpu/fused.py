"""Launchers of the fused CPU layer ops (`fused_ops.cpp`), the `cpu` set of
`radixlm.kernels.layer_ops`. Twins: `rms_norm_ref`, `rope_ref`, `silu_and_mul_ref` and
`store_kv` in `radixlm.kernels.reference`."""

from __future__ import annotations

import torch

from radixlm.kernels.cpu.build import load_error, load_op

_op = load_op()
if _op is None:
    raise ImportError(f"the compiled CPU ops could not be built or loaded: {load_error()}")


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], updated in place to x + residual
) -> torch.Tensor:  # [T, H]
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if residual is None:
        return _op.rms_norm(x, weight, eps)
    return _op.add_rms_norm(x, residual, weight, eps)


def rope(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D], rotated in place
    k: torch.Tensor,  # [T, Hkv, D], rotated in place
    cos: torch.Tensor,  # [P, D] float32
    sin: torch.Tensor,  # [P, D] float32
) -> tuple[torch.Tensor, torch.Tensor]:
    _op.rope_(q, k, positions, cos, sin)
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    return _op.silu_and_mul(x)


def store_kv(
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    out_cache_loc: torch.Tensor,  # [T] int64
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_layout: int = 0,  # 0 flat, 1 pairs16 (`forward_batch.KV_LAYOUTS` index)
) -> None:
    _op.store_kv(k_buf, v_buf, out_cache_loc, k, v, kv_layout)
