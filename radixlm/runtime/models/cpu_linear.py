"""Matmul dtype on CPUs without native bf16 (no AVX512_BF16 / AMX).

There, oneDNN runs a bf16 GEMM by converting to fp32 on the fly: at 8+ rows it is 2-7x slower than
an fp32 GEMM of the same shape (measured on an AVX2 EPYC: 64 x 576 x 3072, 16.5 ms vs 2.9 ms),
while a 1-2 row product (a GEMV, memory-bound) is faster in bf16 (it reads half the bytes).
`matmul_dtype="auto"` therefore keeps the weights in fp32 for compute and a bf16 copy for the
small-row case; the KV cache keeps the model's dtype (bf16: half the attention traffic).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# At most this many rows run the low-precision copy (measured crossover: 2-4 rows).
SMALL_ROWS = 2
MATMUL_DTYPES = ("auto", "model", "float32")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True  # unknown: keep the model dtype
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compute_dtype(model_dtype: torch.dtype, device: torch.device, policy: str) -> torch.dtype:
    """The dtype the model's weights and activations compute in (`policy` in MATMUL_DTYPES)."""
    if policy not in MATMUL_DTYPES:
        raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, got {policy!r}")
    if policy == "model" or model_dtype == torch.float32 or device.type != "cpu":
        return model_dtype
    if policy == "float32" or not cpu_has_native_bf16():
        return torch.float32
    return model_dtype


class SmallRowsLowpLinear(nn.Linear):
    """An fp32 `nn.Linear` that multiplies inputs of at most `SMALL_ROWS` rows with a
    low-precision copy of its weight (and returns fp32)."""

    weight_lowp: torch.Tensor
    bias_lowp: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if x.shape[0] <= SMALL_ROWS:
            return F.linear(x.to(self.weight_lowp.dtype), self.weight_lowp, self.bias_lowp).to(
                x.dtype
            )
        return F.linear(x, self.weight, self.bias)


def add_lowp_copies(model: nn.Module, lowp: torch.dtype) -> int:
    """Give every `nn.Linear` of `model` a `lowp` weight copy for small-row inputs; returns how
    many. NOTE: call after the weights are loaded (the copies are not kept in sync)."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallRowsLowpLinear
            module.weight_lowp = module.weight.detach().to(lowp)
            module.bias_lowp = None if module.bias is None else module.bias.detach().to(lowp)
            count += 1
    return count
