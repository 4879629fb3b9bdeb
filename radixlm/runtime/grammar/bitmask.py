"""Token bitmasks: allocate, fill helpers, and the batched apply to logits.

Layout (xgrammar's, which outlines-core shares): an int32 tensor ``[B, ceil(V / 32)]``; token
``t`` of row ``r`` is allowed iff bit ``t % 32`` of ``bitmask[r, t // 32]`` is 1. Backends fill
rows on the CPU; ``apply_token_bitmask`` moves the mask to the logits' device and masks every
selected row in one call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

_ALL_ALLOWED = -1  # int32 with all 32 bits set


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A CPU int32 bitmask ``[batch_size, ceil(vocab_size / 32)]`` with every token allowed.
    Allocate it once with the model's vocabulary (logits width) and reuse it across steps;
    ``pin_memory`` speeds up the copy to a GPU."""
    return torch.full(
        (batch_size, bitmask_width(vocab_size)),
        _ALL_ALLOWED,
        dtype=torch.int32,
        pin_memory=pin_memory,
    )


def row_pointer(bitmask: torch.Tensor, row: int) -> tuple[int, int]:
    """The address and byte size of row ``row`` of a CPU int32 ``[B, W]`` bitmask with
    contiguous rows, for native fills that write through a pointer (checked: a wrong address
    would write outside the tensor). No row view is made (~5 us of Python each)."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be a 2-D CPU int32 tensor, got {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    rows, width = bitmask.shape
    if not 0 <= row < rows:
        raise IndexError(f"bitmask row {row} out of range for {rows} rows")
    if bitmask.stride(1) != 1:
        raise ValueError("bitmask rows must be contiguous")
    return bitmask.data_ptr() + 4 * row * bitmask.stride(0), 4 * width


def reset_bitmask(bitmask: torch.Tensor) -> None:
    """Allow every token in every row."""
    bitmask.fill_(_ALL_ALLOWED)


def fill_bitmask_tokens(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """Make row ``row`` allow exactly ``token_ids``."""
    bitmask[row].zero_()
    set_bitmask_bits(bitmask, row, token_ids, allowed=True)


def set_bitmask_bits(
    bitmask: torch.Tensor, row: int, token_ids: Sequence[int], *, allowed: bool
) -> None:
    """Allow (or disallow) ``token_ids`` in row ``row``, leaving the other bits alone."""
    words = bitmask[row]  # [W]
    for t in token_ids:
        w, bit = divmod(int(t), 32)
        cur = int(words[w]) & 0xFFFFFFFF
        new = cur | (1 << bit) if allowed else cur & ~(1 << bit)
        words[w] = new - (1 << 32) if new >= 1 << 31 else new  # back to signed int32


def is_token_allowed(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    w, bit = divmod(token_id, 32)
    return bool((int(bitmask[row, w]) >> bit) & 1)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack ``[B, W]`` int32 into a ``[B, vocab_size]`` bool allow-list (True = allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()  # [B, V]


@functools.lru_cache(maxsize=256)
def _row_ids(rows: tuple[int, ...]) -> torch.Tensor:
    """``rows`` as an int64 CPU tensor ``[R]``, kept per tuple (read only; a fresh one costs
    ~5-30 us a step)."""
    return torch.tensor(rows, dtype=torch.long)


def apply_token_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Pure-torch twin of ``apply_token_bitmask`` (the test oracle and the fallback)."""
    vocab = logits.shape[-1]
    idx = (
        torch.arange(logits.shape[0], device=logits.device)
        if rows is None
        else torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    )  # [R]
    allowed = bitmask_to_bool(bitmask.to(logits.device)[idx], vocab)  # [R, V]
    logits[idx] = logits[idx].masked_fill(~allowed, -torch.inf)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """In place: ``logits[r, t] = -inf`` wherever bit ``t`` of ``bitmask[r]`` is 0, for each
    ``r`` in ``rows`` (all rows when None; rows index logits and bitmask alike).

    ``logits``: ``[B, V]`` float of any dtype on any device; ``bitmask``: ``[B', W]`` int32
    (CPU or the logits' device) with ``32 * W >= V``. One batched call: on CPU the compiled op
    (``apply_token_bitmask_``, ~1 us a row against ~50 us for xgrammar's CPU kernel), else
    xgrammar's kernel (Triton on CUDA), or the torch twin when neither is there.
    """
    if rows is not None and len(rows) == 0:
        return
    vocab = logits.shape[-1]
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[-1] * 32 < vocab:
        raise ValueError(
            f"bitmask must be int32 [B, >= ceil({vocab} / 32)], got {bitmask.dtype} "
            f"{tuple(bitmask.shape)}"
        )
    if rows is None:
        if bitmask.shape[0] < logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}")
        bitmask = bitmask[: logits.shape[0]]
    if bitmask.device != logits.device:
        # NOTE: with a pinned bitmask this copy is asynchronous: refill the CPU buffer only
        # after this step's sampled tokens were read back (which synchronizes the stream).
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        from radixlm.kernels.cpu.build import load_op  # the compiled CPU ops, or None

        op = load_op()
        if op is not None and logits.stride(-1) == 1:
            idx = range(logits.shape[0]) if rows is None else rows
            op.apply_token_bitmask_(logits, bitmask.contiguous(), _row_ids(tuple(idx)))
            return
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - xgrammar ships with the grammar extra
        apply_token_bitmask_torch(logits, bitmask, rows)
        return
    indices = None if rows is None else [int(r) for r in rows]
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
