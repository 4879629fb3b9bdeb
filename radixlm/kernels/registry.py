"""Attention backends by name. A backend is a class `(kv_cache) -> backend` with
`init_forward(batch)` (plan once per forward) and `forward(layer_id, q, k, v, scale) -> out`
(store the new K/V into the paged cache, then attend)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_BACKENDS: dict[str, type] = {}
# Backends whose module is imported only when asked for (keeps CUDA-only code out of CPU imports).
_LAZY: dict[str, str] = {"torch": "radixlm.kernels.reference"}


def register_attention_backend(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        _BACKENDS[name] = cls
        return cls

    return wrap


def resolve_backend_name(name: str, device_type: str) -> str:
    """`auto` picks the fastest backend available for the device."""
    if name != "auto":
        return name
    if device_type == "cuda" and "triton" in available_backends():
        return "triton"
    return "torch"


def available_backends() -> list[str]:
    return sorted(set(_BACKENDS) | set(_LAZY))


def create_attention_backend(name: str, kv_cache: Any) -> Any:
    if name not in _BACKENDS and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention_backend {name!r}; available: {', '.join(available_backends())}"
        )
    return _BACKENDS[name](kv_cache)
