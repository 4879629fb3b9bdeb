"""`ForwardBatch`: the tensors one model forward needs, and the paged KV buffers.

Layout (shared by every attention backend):

- The KV cache of layer `l` is `k_buffers[l]`, `v_buffers[l]`: `[num_pages * page_size, Hkv, D]`.
  Token `j` of a sequence lives at slot `page_table[j // page_size] * page_size + j % page_size`.
  `KVCache.layout` says how a slot's `[Hkv, D]` values lie in memory: `flat` (row `slot` of the
  buffer, every backend) or `pairs16` (the CPU op's bf16 layout: slots in blocks of 16, K stored
  as (d, d + 1) pairs across the block's keys and V as (key 2i, key 2i + 1) pairs, the operand
  layouts of AVX512_BF16 dot products; see `pairs16_from_flat`). A page's values stay one
  contiguous run of memory in both, so whole-page copies (copy-on-write, the KV tier) do not
  depend on the layout.
- A batch is ragged: the `T` new tokens of all `B` requests are concatenated, request `i` owning
  rows `qo_indptr[i]:qo_indptr[i + 1]`. Its tokens sit at positions
  `prefix_lens[i] .. seq_lens[i] - 1`; they attend to the cached prefix and causally to each other.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from radixlm.kernels.host_memory import zeros_huge

KV_LAYOUTS = ("flat", "pairs16")


def pairs16_from_flat(buf: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows `[S, Hkv, D]` (S % 16 == 0) -> the same values stored in the `pairs16` layout (same
    shape). Per block of 16 slots and per head: K as `[D/2, 16, 2]` (pair p of key o at
    `p * 32 + 2 * o`), V as `[8, D, 2]` (keys 2i, 2i + 1 of dim d at `i * 2D + 2d`)."""
    s, h, d = buf.shape
    if kind == "k":
        y = buf.view(s // 16, 16, h, d // 2, 2).permute(0, 2, 3, 1, 4)  # [b, h, d/2, 16, 2]
    else:
        y = buf.view(s // 16, 8, 2, h, d).permute(0, 3, 1, 4, 2)  # [b, h, 8, d, 2]
    return y.contiguous().view(s, h, d)


def flat_from_pairs16(buf: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of `pairs16_from_flat`: `pairs16` storage `[S, Hkv, D]` -> rows by slot."""
    s, h, d = buf.shape
    if kind == "k":
        y = buf.view(s // 16, h, d // 2, 16, 2).permute(0, 3, 1, 2, 4)  # [b, 16, h, d/2, 2]
    else:
        y = buf.view(s // 16, h, 8, d, 2).permute(0, 2, 4, 1, 3)  # [b, 8, 2, h, d]
    return y.contiguous().view(s, h, d)


def pairs16_offsets(slots: torch.Tensor, h: int, d: int, kind: str) -> torch.Tensor:
    """Flat element offsets `[T, Hkv, D]` of the `pairs16` values of these slots."""
    s = slots.to(torch.int64)[:, None, None]
    hh = torch.arange(h, device=slots.device)[None, :, None]
    dd = torch.arange(d, device=slots.device)[None, None, :]
    o = s % 16
    base = (s - o) * h * d + hh * 16 * d
    if kind == "k":
        return base + (dd // 2) * 32 + 2 * o + dd % 2
    return base + (o // 2) * 2 * d + 2 * dd + o % 2


@dataclass
class KVCache:
    """Per-layer K and V slot buffers: `[num_slots, num_kv_heads, head_dim]` each, in `layout`
    (one of `KV_LAYOUTS`, fixed at allocation: every writer and reader follows it)."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    page_size: int
    layout: str = "flat"

    def __post_init__(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"KV layout must be one of {KV_LAYOUTS}, got {self.layout!r}")
        if self.layout == "pairs16" and (self.page_size % 16 or self.k_buffers[0].shape[2] % 2):
            raise ValueError("the pairs16 KV layout needs page_size % 16 == 0 and an even D")

    def read_rows(self, layer: int, kind: str, slots: torch.Tensor) -> torch.Tensor:
        """The `[T, Hkv, D]` values of these slots, whatever the layout (tests, twins)."""
        buf = (self.k_buffers if kind == "k" else self.v_buffers)[layer]
        if self.layout == "flat":
            return buf[slots]
        _, h, d = buf.shape
        return buf.view(-1)[pairs16_offsets(slots, h, d, kind)]

    def write_rows(self, layer: int, kind: str, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store `x` `[T, Hkv, D]` at these slots (cast to the cache dtype), in the layout."""
        buf = (self.k_buffers if kind == "k" else self.v_buffers)[layer]
        if self.layout == "flat":
            buf[slots] = x.to(buf.dtype)
            return
        _, h, d = buf.shape
        buf.view(-1)[pairs16_offsets(slots, h, d, kind)] = x.to(buf.dtype)

    def as_layout(self, layout: str) -> KVCache:
        """A copy of this cache's values in another layout (tests, benchmarks)."""
        if layout == self.layout:
            return KVCache(
                [b.clone() for b in self.k_buffers], [b.clone() for b in self.v_buffers],
                self.page_size, layout,
            )  # fmt: skip
        conv = pairs16_from_flat if layout == "pairs16" else flat_from_pairs16
        return KVCache(
            [conv(b, "k") for b in self.k_buffers],
            [conv(b, "v") for b in self.v_buffers],
            self.page_size,
            layout,
        )

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: str = "flat",
        layers: Collection[int] | None = None,
    ) -> KVCache:
        """Zeroed buffers of `num_pages` pages for every layer, or only for `layers` (the
        others' buffers are empty `[0, Hkv, D]`: a hybrid pool's other cache holds them). On CPU
        in memory advised for huge pages (`host_memory.zeros_huge`)."""

        def buf(layer: int) -> torch.Tensor:
            slots = num_pages * page_size if layers is None or layer in layers else 0
            if torch.device(device).type == "cpu":
                return zeros_huge((slots, num_kv_heads, head_dim), dtype)
            return torch.zeros((slots, num_kv_heads, head_dim), dtype=dtype, device=device)

        return cls(
            k_buffers=[buf(i) for i in range(num_layers)],
            v_buffers=[buf(i) for i in range(num_layers)],
            page_size=page_size,
            layout=layout,
        )

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (all layers): used for copy-on-write of a partial last page."""
        if not src:
            return
        ps = self.page_size
        device = self.k_buffers[0].device
        src_slots = (
            torch.tensor(src, device=device)[:, None] * ps + torch.arange(ps, device=device)
        ).flatten()
        dst_slots = (
            torch.tensor(dst, device=device)[:, None] * ps + torch.arange(ps, device=device)
        ).flatten()
        for buf in (*self.k_buffers, *self.v_buffers):
            if buf.shape[0]:  # NOTE: a hybrid pool's cache holds empty buffers for other layers
                buf[dst_slots] = buf[src_slots]


@dataclass
class ForwardBatch:
    """One ragged forward: `T` new tokens from `B` requests. All tensors on the model device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 slot where each new token's K/V is written
    seq_lens: torch.Tensor  # [B] int32 kv length after this step (prefix + new)
    prefix_lens: torch.Tensor  # [B] int32 tokens already in the cache before this step
    extend_lens: torch.Tensor  # [B] int32 new tokens this step
    qo_indptr: torch.Tensor  # [B + 1] int32 row offsets of each request's new tokens
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    logits_indices: torch.Tensor  # [R] int64 rows of the T tokens whose logits are returned
    page_size: int
    # Host copies (the torch backend plans with these; no device sync needed).
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)

    @classmethod
    def build(
        cls,
        token_chunks: list[list[int]],
        prefix_lens: list[int],
        page_lists: list[list[int]],
        logits_rows: list[list[int]],
        page_size: int,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Build from host lists (tests, benchmarks; the engine keeps a persistent page table
        and calls `from_parts`).

        `token_chunks[i]` are request i's new tokens at positions `prefix_lens[i]...`;
        `page_lists[i]` its page table (must cover `prefix_lens[i] + len(token_chunks[i])`);
        `logits_rows[i]` the offsets within its chunk whose logits are wanted.
        """
        max_pages = max((len(p) for p in page_lists), default=1) or 1
        table = torch.zeros((len(page_lists), max_pages), dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            if pages:
                table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        ids: list[int] = []
        rows: list[int] = []
        for chunk, want in zip(token_chunks, logits_rows):
            rows.extend(len(ids) + r for r in want)
            ids.extend(chunk)
        extend = [len(c) for c in token_chunks]
        return cls.from_parts(ids, prefix_lens, extend, table, rows, page_size, device)

    @classmethod
    def from_parts(
        cls,
        input_ids: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        page_table: torch.Tensor | np.ndarray,
        logits_rows: list[int],
        page_size: int,
        device: torch.device | str,
    ) -> ForwardBatch:
        """`input_ids` are the `T` new tokens of `B` requests back to back (request i: the next
        `extend_lens[i]`, at positions `prefix_lens[i]...`); `page_table` `[B, >= max pages]`
        int32 on the host (a tensor or an array); `logits_rows` index `input_ids`. Positions and
        slots are computed with NumPy array ops: no per-token Python, and ~2-3x fewer
        microseconds than the same dozen small torch ops (each an eager dispatch)."""
        seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
        num_tokens = len(input_ids)
        max_pages = max(-(-s // page_size) for s in seq) if seq else 1
        host = page_table.numpy() if isinstance(page_table, torch.Tensor) else page_table
        table = np.ascontiguousarray(host[:, : max(1, max_pages)], dtype=np.int32)  # [B, P]
        ext = np.asarray(extend_lens, dtype=np.int64)  # [B]
        pre = np.asarray(prefix_lens, dtype=np.int64)  # [B]
        indptr = np.zeros(len(extend_lens) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum(ext, out=indptr[1:])
        owner = np.repeat(np.arange(len(extend_lens)), ext)  # [T]
        positions = np.arange(num_tokens, dtype=np.int64) - indptr[:-1][owner] + pre[owner]  # [T]
        slots = table[owner, positions // page_size].astype(np.int64) * page_size  # [T]
        slots += positions % page_size

        def dev(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(x).to(device, non_blocking=True)

        return cls(
            input_ids=dev(np.asarray(input_ids, dtype=np.int64)),
            positions=dev(positions),
            out_cache_loc=dev(slots),
            seq_lens=dev(np.asarray(seq, dtype=np.int32)),
            prefix_lens=dev(pre.astype(np.int32)),
            extend_lens=dev(ext.astype(np.int32)),
            qo_indptr=dev(indptr.astype(np.int32)),
            page_table=dev(table),
            logits_indices=dev(np.asarray(logits_rows, dtype=np.int64)),
            page_size=page_size,
            seq_lens_cpu=seq,
            extend_lens_cpu=list(extend_lens),
        )
