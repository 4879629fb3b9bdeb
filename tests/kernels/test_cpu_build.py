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
    ):
        assert hasattr(op, name), name
