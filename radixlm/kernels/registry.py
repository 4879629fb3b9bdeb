"""Attention backends by name. A backend is a class `(kv_cache) -> backend` with
`init_forward(batch)` (plan once per forward) and `forward(layer_id, q, k, v, scale) -> out`
(store the new K/V into the paged cache, then attend)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

_BACKENDS: dict[str, type] = {}
# Backends whose module is imported only when asked for (keeps CUDA-only code out of CPU imports).
_LAZY: dict[str, str] = {
    "torch": "radixlm.kernels.reference",
    "cpu": "radixlm.kernels.cpu.backend",
    "triton": "radixlm.kernels.triton_backend",
}


def register_attention_backend(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        _BACKENDS[name] = cls
        return cls

    return wrap


def resolve_backend_name(name: str, device_type: str) -> str:
    """`auto` picks the fastest backend available for the device: `triton` on CUDA when the
    triton package is installed (looked up, not imported); `cpu` on CPU when the compiled op
    builds or loads (else one log line says why, and `torch`); else `torch`."""
    if name != "auto":
        return name
    if device_type == "cuda" and "triton" in available_backends() and _triton_installed():
        return "triton"
    if device_type == "cpu" and _cpu_op_available():
        return "cpu"
    return "torch"


def _cpu_op_available() -> bool:
    from radixlm.kernels.cpu.build import load_op

    return load_op() is not None


def _triton_installed() -> bool:
    return "triton" in _BACKENDS or importlib.util.find_spec("triton") is not None


def available_backends() -> list[str]:
    return sorted(set(_BACKENDS) | set(_LAZY))


def preferred_kv_layout(name: str, dtype: Any, page_size: int, head_dim: int) -> str:
    """The KV cache layout backend `name` reads fastest (`forward_batch.KV_LAYOUTS`): its
    `preferred_kv_layout` where it has one, else `flat` (also for a backend that does not load:
    `create_attention_backend` then says why)."""
    if name not in _BACKENDS and name in _LAZY:
        try:
            importlib.import_module(_LAZY[name])
        except ImportError:
            return "flat"
    pick = getattr(_BACKENDS.get(name), "preferred_kv_layout", None)
    return pick(dtype, page_size, head_dim) if pick is not None else "flat"


def create_attention_backend(name: str, kv_cache: Any) -> Any:
    if name not in _BACKENDS and name in _LAZY:
        try:
            importlib.import_module(_LAZY[name])
        except ImportError as e:
            raise ImportError(f"attention_backend {name!r} is unavailable: {e}") from e
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention_backend {name!r}; available: {', '.join(available_backends())}"
        )
    return _BACKENDS[name](kv_cache)
