"""The resident size of a model's weights, whatever form they are in (float parameters, oneDNN
prepacked copies, quantized buffers)."""

from __future__ import annotations

import torch
from torch import nn


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _key(t: torch.Tensor) -> tuple[int, int] | int:
    """Where the tensor's bytes are: its own start (views of one arena, e.g. the packed bf16
    weights, are distinct weights) and size."""
    try:
        return t.data_ptr(), _nbytes(t)
    except (RuntimeError, NotImplementedError):  # opaque (MKLDNN) tensors have no storage
        return id(t)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct weight tensor the model's modules hold: parameters, persistent
    buffers and plain tensor attributes (prepacked weights, low-precision copies). Non-persistent
    buffers (RoPE tables) are not weights. A tensor shared by two modules counts once."""
    seen: set[tuple[int, int] | int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module._parameters.values())
        tensors += [
            b for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            k = _key(t)
            if k not in seen:
                seen.add(k)
                total += _nbytes(t)
    return total
