"""Host buffers in transparent huge pages (`kernels/host_memory.py`): zeroed, 2 MB-aligned,
writable, of any dtype; advised for huge pages where the kernel's THP mode allows it (checked in
/proc/self/smaps), and used by the CPU KV pool; glibc told to keep freed activations."""

from __future__ import annotations

import random
import resource
import sys
from pathlib import Path

import pytest
import torch

from radixlm.kernels.forward_batch import KVCache
from radixlm.kernels.host_memory import keep_freed_memory, zeros_huge

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


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_freed_activations_are_reused_without_page_faults():
    """After ``keep_freed_memory``, buffers of 1-12 MB (a forward's activations) allocated
    after others of the same sizes were freed reuse their memory once the heap has grown:
    almost none of their pages is faulted in again (~60 of ~400k here; by default glibc maps
    or trims some anew: ~1.8k, and tens of thousands per round in a real engine)."""
    assert keep_freed_memory()
    rng = random.Random(0)

    def buffers() -> list[torch.Tensor]:
        return [torch.ones(rng.randrange(1 << 20, 12 << 20) // 4) for _ in range(5)]

    faults = touched = 0
    for k in range(80):
        first = buffers()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        del first
        second = buffers()
        if k >= 30:  # the first rounds grow the heap
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            touched += sum(x.numel() * 4 // 4096 for x in second)
        del second
    assert faults < touched // 500, (faults, touched)
