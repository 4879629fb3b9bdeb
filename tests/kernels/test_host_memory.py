"""Host buffers in transparent huge pages (`kernels/host_memory.py`): zeroed, 2 MB-aligned,
writable, of any dtype; advised for huge pages where the kernel's THP mode allows it (checked in
/proc/self/smaps), and used by the CPU KV pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixlm.kernels.forward_batch import KVCache
from radixlm.kernels.host_memory import zeros_huge

HUGE = 2 << 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int32])
def test_zeros_huge_is_a_zeroed_aligned_writable_tensor(dtype):
    t = zeros_huge((3, 100_000, 7), dtype)
    assert t.shape == (3, 100_000, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE == 0
    assert not t.any()
    t[1, 5, 3] = 4
    assert t.sum().item() == 4
    assert zeros_huge((0, 4), dtype).shape == (0, 4)
    small = zeros_huge((10, 4), dtype)  # under one huge page: plain zeros
    assert small.shape == (10, 4) and not small.any()


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text.split("[", 1)[1].split("]", 1)[0]


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping that holds `addr` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="THP is off here")
def test_zeros_huge_is_advised_for_huge_pages():
    """The mapping carries MADV_HUGEPAGE (`hg` in its VmFlags): whether the kernel then finds
    free 2 MB pages depends on the machine's memory, the advice does not."""
    t = zeros_huge((8 << 20,), torch.uint8)  # 8 MB
    assert "hg" in _vm_flags(t.data_ptr())


def test_cpu_kv_pool_is_in_huge_page_memory():
    cache = KVCache.allocate(2, 4096, 16, 2, 8, torch.bfloat16, "cpu")  # 2 MB per buffer
    for buf in (*cache.k_buffers, *cache.v_buffers):
        assert buf.data_ptr() % HUGE == 0 and not buf.any()
