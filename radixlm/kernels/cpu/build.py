"""Build and load the compiled CPU ops (`torch.utils.cpp_extension`, JIT into a stable cache).

The build directory is `<cache>/cpu_ops/<key>`, keyed by the sources' hash, the torch version and
the CPU's instruction-set flags (the op is compiled with `-march=native`), so a machine builds
once (`python -m radixlm.kernels.cpu.build`, run by `scripts/setup.sh`) and every later process
loads the built library in well under a second. `<cache>` is `$RADIXLM_CACHE`, else the
platform's user cache dir (the same root as the model cache).

`load_op()` never raises: where the op cannot be built or loaded it logs one line saying why and
returns None, and callers fall back to the torch twin.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

NAME = "radixlm_cpu_ops"
SOURCES = (
    "paged_attention.cpp",
    "fused_ops.cpp",
    "threads.cpp",
    "decoder.cpp",
    "quant_ops.cpp",
    "linear_bf16.cpp",
    "int4_gemm.cpp",
    "int8_gemm.cpp",
    "sampling_ops.cpp",
)
HEADERS = ("simd.h", "vec.h", "logits_masks.h")  # included by the sources: part of the build key
EXTRA_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno")
EXTRA_LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_op: Any = None  # torch.ops.radixlm_cpu once loaded
_error: str | None = None


def cache_root() -> Path:
    env = os.environ.get("RADIXLM_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("radixlm"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    """Hash of the sources and headers, compile flags, torch and Python versions, and CPU flags."""
    import torch

    h = hashlib.sha256()
    src_dir = Path(__file__).parent
    for name in (*SOURCES, *HEADERS):
        h.update((src_dir / name).read_bytes())
    h.update(" ".join(EXTRA_CFLAGS + EXTRA_LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    return cache_root() / "cpu_ops" / build_key()


def _build(verbose: bool = False) -> Any:
    import torch

    directory = build_dir()
    built = directory / f"{NAME}.so"
    if built.exists():  # the key covers sources, flags, torch, Python, CPU: load it directly
        torch.ops.load_library(str(built))
        return torch.ops.radixlm_cpu
    import torch.utils.cpp_extension as cpp  # imports setuptools (~1 s): only to build

    directory.mkdir(parents=True, exist_ok=True)
    src_dir = Path(__file__).parent
    cpp.load(
        name=NAME,
        sources=[str(src_dir / s) for s in SOURCES],
        extra_cflags=list(EXTRA_CFLAGS),  # copies: cpp_extension appends to these lists
        extra_ldflags=list(EXTRA_LDFLAGS),
        build_directory=str(directory),
        verbose=verbose,
        is_python_module=False,  # a TORCH_LIBRARY op: loaded into torch.ops.radixlm_cpu
    )
    return torch.ops.radixlm_cpu


def _summary(e: BaseException) -> str:
    """One line: the compiler's first `error:` line when there is one, else the message's first."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    line = (errors or lines or [""])[0]
    return f"{type(e).__name__}: {line[:300]}"


def load_op(verbose: bool = False) -> Any:
    """`torch.ops.radixlm_cpu` (built on first use if not in the cache), or None (logged once).

    Its ops: `paged_attention` (`paged_attention.cpp`); the fused layer ops `rms_norm`,
    `add_rms_norm`, `rope_`, `silu_and_mul`, `store_kv` (`fused_ops.cpp`, launchers in
    `fused.py`); `pin_threads`, `release_thread_pools` (`threads.cpp`); `decoder_stack`
    (`decoder.cpp`); `int4_dequantize_t` (`quant_ops.cpp`);
    `int4_g32_mm` (`int4_gemm.cpp`); `pack_bf16_linear`, `linear_bf16` (`linear_bf16.cpp`);
    `apply_token_bitmask_`, `argmax_rows`, `redraw_row_`, `sample_rows` (`sampling_ops.cpp`)."""
    global _op, _error
    with _lock:
        if _op is not None or _error is not None:
            return _op
        try:
            _op = _build(verbose)
        except Exception as e:  # compiler missing, build error, load error: fall back
            _error = _summary(e)
            logger.warning(
                "CPU attention op unavailable (%s); using the torch attention backend", _error
            )
        return _op


def load_error() -> str | None:
    """Why `load_op()` returned None (None when it loaded or was not tried)."""
    return _error


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    op = load_op(verbose="-v" in sys.argv)
    if op is None:
        print(f"radixlm: CPU attention op NOT built ({_error}); the torch backend will be used")
        return 0  # setup must not fail on a machine without a compiler
    print(f"radixlm: CPU attention op built in {build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
