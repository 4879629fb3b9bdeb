"""Weight-only low-bit matmul kernels by (device type, bits): how a `QuantizedWeight` is packed into
a kernel's layout, and the call that multiplies by it. All are torch's own ops (no extra
dependency):

- CPU int8: `aten._weight_int8pack_mm(x, q [N, K] int8, scales [N])`, one scale per output row.
- CPU int4: `aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros [K/g, N, 2])`
  on `aten._convert_weight_to_int4pack_for_cpu(q [N, K] int32)`; it computes
  `w = (q - 8) * scale + zero`, so `zero = min + 8 * scale` (our `w = q * scale + min`).
- CUDA int4: `aten._weight_int4pack_mm` on `aten._convert_weight_to_int4pack` (tinygemm, bf16),
  same zero convention. CUDA int8: `F.linear` on the int8 weight cast to the activation dtype,
  times the row scales (torch has no CUDA weight-only int8 GEMM).

The C++ layer stack (`radixlm/kernels/cpu/decoder.cpp`) calls the same two CPU ops on the same
packed tensors, telling them apart by the weight's dtype (int8 / uint8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.runtime.quantization.weights import QuantizedWeight


@dataclass(frozen=True)
class QuantKernel:
    """`pack(qw, dtype, device) -> (weight, scales)`; `mm(x [T, K], weight, scales) -> [T, N]`."""

    name: str
    pack: Callable[[QuantizedWeight, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]]
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    # The packed int8 weight is the plain [N, K] matrix (an embedding can gather its rows).
    plain_rows: bool = False


def _pack_int8(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    if qw.bits != 8 or qw.group_size != qw.shape[1]:
        raise ValueError("the int8 kernels take one scale per output row")
    return qw.q.contiguous().to(device), qw.scales[:, 0].to(device=device, dtype=dtype)


def _scales_and_zeros(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:  # [K/g, N, 2]
    if qw.bits != 4:
        raise ValueError("the int4 kernels take 4-bit weights")
    zeros = qw.mins + 8 * qw.scales  # type: ignore[operator]
    return torch.stack([qw.scales, zeros], dim=-1).transpose(0, 1).to(dtype).contiguous()


def _pack_int4_cpu(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32), 1)
    return packed, _scales_and_zeros(qw, dtype)


def _mm_int8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, w, s)


def _mm_int4_cpu(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, x.shape[-1] // sz.shape[0], sz)


CUDA_INNER_K_TILES = 8


def _pack_int4_cuda(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    q = qw.q.to(device)
    nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K/2]
    packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, CUDA_INNER_K_TILES)
    return packed, _scales_and_zeros(qw, dtype).to(device)


def _mm_int4_cuda(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x, w, x.shape[-1] // sz.shape[0], sz)


def _mm_int8_cuda(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype)) * s


KERNELS: dict[tuple[str, int], QuantKernel] = {
    ("cpu", 8): QuantKernel("aten._weight_int8pack_mm", _pack_int8, _mm_int8, plain_rows=True),
    ("cpu", 4): QuantKernel("aten._weight_int4pack_mm_for_cpu", _pack_int4_cpu, _mm_int4_cpu),
    ("cuda", 8): QuantKernel("int8 weight, F.linear", _pack_int8, _mm_int8_cuda, plain_rows=True),
    ("cuda", 4): QuantKernel("aten._weight_int4pack_mm", _pack_int4_cuda, _mm_int4_cuda),
}


def get_kernel(device_type: str, bits: int) -> QuantKernel:
    try:
        return KERNELS[(device_type, bits)]
    except KeyError:
        raise ValueError(f"no int{bits} weight-only kernel for device {device_type!r}") from None
