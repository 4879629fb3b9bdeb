"""Host buffers in transparent huge pages.

A CPU decode step streams every packed weight once and reads each request's K/V from pages
scattered over the pool. With 4 KB pages every 4 KB of that costs a TLB miss; backed by 2 MB
pages, SmolLM2-135M's decode steps measured 4-15% faster (weights, batch 1-32) and its decode
attention 17-20% faster (KV pool), both A/B in one process (README, "CPU matmuls").

`zeros_huge` maps anonymous memory, advises it `MADV_HUGEPAGE` (effective where transparent huge
pages are `madvise` or `always`; with `never`, or off Linux, it is plain memory: same contents,
same speed as before) and writes its zeros at once, as `torch.zeros` does: every page is faulted
in at allocation (start-up), never by a forward (a huge-page fault zeroes 2 MB and may compact
memory first). That costs start-up time: the engine's first `Engine()` measured 9.2-10.1 s vs
6.3-7.7 s with 4 KB pages (SmolLM2-135M, a ~5 GB KV pool, 2 cores; a huge-page fault of memory
the VM has not touched yet is slow). Buffers under 2 MB are ordinary `torch.zeros`.

`keep_freed_memory` keeps what a forward frees for the next one: torch's CPU allocator takes
every activation from malloc, and glibc maps each one over its threshold anew (and trims its
heaps' freed tops), so each forward faulted in and zeroed its activations again.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

_HUGE = 2 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP = 1 << 30  # bytes: larger allocations are still mapped, and unmapped when freed


def keep_freed_memory() -> bool:
    """glibc's malloc (process-wide) keeps freed blocks of up to 1 GB for reuse: no mapping per
    allocation, no trimming of the heaps (the process keeps its peak heap). SmolLM2-135M, 16
    prompts of 128-512 tokens with 16 tokens out, 2 threads: 51k-364k page faults and 0.2-1.1 s
    of system time per round before, 79-5k faults and 0.01-0.03 s after. False where it does not
    apply (not glibc, or a glibc that refuses the thresholds; then 32 MB, its usual ceiling)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not mallopt(_M_MMAP_THRESHOLD, _KEEP) and not mallopt(_M_MMAP_THRESHOLD, 32 << 20):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, _KEEP))


def zeros_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of `shape` in its own anonymous mapping advised for huge pages, its
    pages faulted in (under 2 MB: `torch.zeros`). The tensor keeps the mapping alive (unmapped
    when the last view is freed)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE:  # not one huge page: it would only waste the rest of one
        return torch.zeros(shape, dtype=dtype)
    # private (shared anonymous memory is shmem, which THP's `enabled` setting does not cover),
    # one huge page more than needed so that the tensor can start on a 2 MB boundary
    size = -(-nbytes // _HUGE) * _HUGE + _HUGE
    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -ctypes.addressof(ctypes.c_char.from_buffer(mem)) % _HUGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # advice only (e.g. a kernel built without THP)
            pass
    t = torch.frombuffer(mem, dtype=dtype, count=numel, offset=offset).view(shape)
    return t.zero_()  # fault every page in now
