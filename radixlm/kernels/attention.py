"""Triton attention kernels: the shared launcher checks, and where each kernel lives.

The kernels are split by job (each file: kernel(s) + a thin launcher that checks shapes, strides,
dtypes and devices; each has a pure-torch twin in `radixlm.kernels.reference`):

- `radixlm.kernels.kv_store`: `store_kv` scatters the new tokens' K/V into their page slots.
- `radixlm.kernels.decode_attention`: `decode_attention`, one query token per request, K/V read
  through pages (`kv_indptr`/`kv_indices`), GQA-grouped, optional split-KV + reduce.
- `radixlm.kernels.extend_attention`: `extend_attention`, a chunk of new tokens on top of a paged
  prefix, causal among themselves (flash-attention style online softmax).
- `radixlm.kernels.fused_ops`: RMSNorm (+ residual add) and RoPE.

Paged addressing shared by all of them (see `radixlm.kernels.forward_batch`): request `r`'s token
at position `j` lives in slot `kv_indices[kv_indptr[r] + j // page_size] * page_size +
j % page_size` of the `[num_slots, Hkv, D]` buffers. A `[B, max_pages]` page table is the special
case `kv_indptr[r] = r * page_table.stride(0)`, `kv_indices = page_table` (flattened); a CSR
layout packs only the pages each request uses.

NOTE: this module imports torch only. Triton is imported by the kernel modules, which are
imported only when the triton backend (or a kernel) is asked for, so `import radixlm` works on a
machine without triton. On CPU the kernels need `TRITON_INTERPRET=1` set before they are imported
(Triton decides interpreted vs compiled when a kernel is decorated).
"""

from __future__ import annotations

import os

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device; CPU tensors only under the interpreter."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {t.device} vs {device}")
    if device.type == "cpu" and not interpret_mode():
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before radixlm's kernel "
            "modules are imported (use attention_backend='torch' on CPU)"
        )


def check_rows(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """`t` has `ndim` dims, an allowed dtype, and a contiguous last dim (kernels take the other
    strides as arguments)."""
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} not in {dtypes}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous, strides {t.stride()}")


def check_index(name: str, t: torch.Tensor, numel: int | None = None) -> None:
    """A 1-D contiguous int32/int64 index tensor (of `numel` entries when given)."""
    if t.dim() != 1 or t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name}: expected 1-D int32/int64, got {t.dtype} {tuple(t.shape)}")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: must be contiguous")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}: expected {numel} entries, got {t.numel()}")


def page_table_indptr(page_table: torch.Tensor) -> torch.Tensor:
    """`kv_indptr` [B + 1] int32 that makes a `[B, max_pages]` page table a paged index:
    request `r`'s pages start at `r * page_table.stride(0)` of the flattened table."""
    b = page_table.shape[0]
    idx = torch.arange(b + 1, dtype=torch.int32, device=page_table.device)
    return idx * page_table.stride(0)


def pages_to_csr(
    page_table: torch.Tensor,  # [B, max_pages] int
    seq_lens: list[int],
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR `(kv_indptr [B + 1] int32, kv_indices [sum pages] int32)` of the pages each request
    uses (host lengths, so no device sync)."""
    counts = [-(-n // page_size) for n in seq_lens]
    indptr = [0]
    for c in counts:
        indptr.append(indptr[-1] + c)
    device = page_table.device
    cols = torch.tensor([j for c in counts for j in range(c)], dtype=torch.int64, device=device)
    rows = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)], device=device)
    indices = page_table[rows.to(torch.int64), cols].to(torch.int32)
    return torch.tensor(indptr, dtype=torch.int32, device=device), indices
