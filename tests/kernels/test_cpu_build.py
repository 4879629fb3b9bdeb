"""The compiled CPU ops must build wherever a compiler exists. The CPU-op tests skip when the op
is unavailable, and the engine then runs the torch twins: without this test a broken build would
leave CI green on the wrong path."""

from __future__ import annotations

import shutil

import pytest

from radixlm.kernels.cpu import build


def test_cpu_ops_build_where_a_compiler_exists() -> None:
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler on this machine: the torch twins are the CPU path")
    assert build.load_op() is not None, f"the CPU ops failed to build: {build.load_error()}"


def test_every_op_is_registered() -> None:
    op = build.load_op()
    if op is None:
        pytest.skip(f"CPU ops unavailable: {build.load_error()}")
    for name in (
        "paged_attention",
        "rms_norm",
        "add_rms_norm",
        "rope_",
        "silu_and_mul",
        "store_kv",
        "pin_threads",
        "release_thread_pools",
        "int4_g32_mm",
    ):
        assert hasattr(op, name), name


@pytest.mark.parametrize("arch", ["haswell", "skylake-avx512"])
def test_sources_compile_for_other_cpus(arch: str) -> None:
    """The ops are built with -march=native: check that they also compile for an AVX2-only CPU
    and for AVX-512 without AVX512_BF16, whose code paths this machine's build leaves out."""
    import subprocess
    import sysconfig
    from pathlib import Path

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    import torch.utils.cpp_extension as cpp

    includes = [f"-I{p}" for p in cpp.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    src = Path(build.__file__).parent
    for name in build.SOURCES:
        cmd = [cxx, "-std=c++17", "-fsyntax-only", f"-march={arch}", "-fopenmp", *includes]
        proc = subprocess.run([*cmd, str(src / name)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name} for {arch}:\n{proc.stderr[-2000:]}"
