"""The elementwise ops of a decoder layer, by backend: `torch` (the reference twins: eager ATen
ops, the numerics every other set is tested against), `cpu` (fused C++ ops, one dispatch each)
and `triton` (fused Triton kernels on CUDA).

A set is a `LayerOps`: three functions with one contract, whatever the backend:

- `rms_norm(x, weight, eps, residual=None) -> y`: `weight * normalize(x)`; with `residual`,
  first `residual <- round(x + residual)` (in place) and normalize that.
- `rope(positions, q, k, cos, sin) -> (q, k)`: neox rotate-half by absolute position, tables
  `[P, D]` float32. NOTE: a set may rotate q and k in place (`cpu` does); callers use the return
  values and never read the inputs afterwards.
- `silu_and_mul(x) -> y`: `[T, 2I] -> [T, I]`, `silu(x[:, :I]) * x[:, I:]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixlm.kernels.reference import rms_norm_ref, rope_ref, silu_and_mul_ref


@dataclass(frozen=True)
class LayerOps:
    name: str
    rms_norm: Callable[..., torch.Tensor]
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH_OPS = LayerOps("torch", rms_norm_ref, rope_ref, silu_and_mul_ref)


def _cpu_ops() -> LayerOps:
    from radixlm.kernels.cpu import fused

    return LayerOps("cpu", fused.rms_norm, fused.rope, fused.silu_and_mul)


def _triton_ops() -> LayerOps:
    from radixlm.kernels import fused_ops

    return LayerOps("triton", fused_ops.rms_norm, fused_ops.apply_rope, silu_and_mul_ref)


_FACTORIES: dict[str, Callable[[], LayerOps]] = {
    "torch": lambda: TORCH_OPS,
    "cpu": _cpu_ops,
    "triton": _triton_ops,
}


def get_layer_ops(name: str) -> LayerOps:
    """The op set `name` (`torch`, `cpu`, `triton`); ImportError when its compiled ops are
    unavailable on this machine."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown layer ops {name!r}; available: {sorted(_FACTORIES)}")
    return _FACTORIES[name]()
