"""`ForwardBatch`: the tensors one model forward needs, and the paged KV buffers.

Layout (shared by every attention backend):

- The KV cache of layer `l` is `k_buffers[l]`, `v_buffers[l]`: `[num_pages * page_size, Hkv, D]`.
  Token `j` of a sequence lives at slot `page_table[j // page_size] * page_size + j % page_size`.
- A batch is ragged: the `T` new tokens of all `B` requests are concatenated, request `i` owning
  rows `qo_indptr[i]:qo_indptr[i + 1]`. Its tokens sit at positions
  `prefix_lens[i] .. seq_lens[i] - 1`; they attend to the cached prefix and causally to each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Per-layer K and V slot buffers: `[num_slots, num_kv_heads, head_dim]` each."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    page_size: int

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
    ) -> KVCache:
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        return cls(
            k_buffers=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v_buffers=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            page_size=page_size,
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
        """Build from host lists.

        `token_chunks[i]` are request i's new tokens at positions `prefix_lens[i]...`;
        `page_lists[i]` its page table (must cover `prefix_lens[i] + len(token_chunks[i])`);
        `logits_rows[i]` the offsets within its chunk whose logits are wanted.
        """
        extend = [len(c) for c in token_chunks]
        seq = [p + e for p, e in zip(prefix_lens, extend)]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        offset = 0
        for chunk, start, pages, want in zip(token_chunks, prefix_lens, page_lists, logits_rows):
            input_ids.extend(chunk)
            for pos in range(start, start + len(chunk)):
                positions.append(pos)
                slots.append(pages[pos // page_size] * page_size + pos % page_size)
            rows.extend(offset + r for r in want)
            offset += len(chunk)
        max_pages = max((len(p) for p in page_lists), default=1) or 1
        table = torch.zeros((len(page_lists), max_pages), dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            if pages:
                table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        indptr = [0]
        for e in extend:
            indptr.append(indptr[-1] + e)

        def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

        return cls(
            input_ids=t(input_ids, torch.int64),
            positions=t(positions, torch.int64),
            out_cache_loc=t(slots, torch.int64),
            seq_lens=t(seq, torch.int32),
            prefix_lens=t(prefix_lens, torch.int32),
            extend_lens=t(extend, torch.int32),
            qo_indptr=t(indptr, torch.int32),
            page_table=table.to(device, non_blocking=True),
            logits_indices=t(rows, torch.int64),
            page_size=page_size,
            seq_lens_cpu=seq,
            extend_lens_cpu=extend,
        )
