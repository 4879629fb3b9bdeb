"""Pure-torch paged attention: the CPU path and the oracle that every kernel is tested against.

Semantics (see `radixlm.runtime.forward_batch`): request `i`'s new tokens (rows
`qo_indptr[i]:qo_indptr[i+1]`) sit at positions `prefix_lens[i]..seq_lens[i]-1`; each attends to
every cached token of its own sequence at a position <= its own. K/V of the new tokens are first
scattered into their slots, then read back through the page table with the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels.registry import register_attention_backend
from radixlm.runtime.forward_batch import ForwardBatch, KVCache


def store_kv(
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    out_cache_loc: torch.Tensor,  # [T]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
) -> None:
    """Scatter the new tokens' K/V into their cache slots."""
    k_buf[out_cache_loc] = k.to(k_buf.dtype)
    v_buf[out_cache_loc] = v.to(v_buf.dtype)


def page_slots(page_table_row: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    """Slots of tokens `0..seq_len-1` of one sequence: `[seq_len]` int64."""
    npages = (seq_len + page_size - 1) // page_size
    pages = page_table_row[:npages].to(torch.int64)
    offs = torch.arange(page_size, device=pages.device)
    return (pages[:, None] * page_size + offs).flatten()[:seq_len]


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] rows of q (one per request)
    slots: torch.Tensor  # [Bd, L] int64 slot of each key position (padding: slot 0)
    mask: torch.Tensor  # [Bd, 1, 1, L] bool, True = attend


@dataclass
class _ExtendItem:
    start: int
    end: int
    slots: torch.Tensor  # [seq_len]
    mask: torch.Tensor | None  # [e, seq_len] bool; None when causal from position 0


@dataclass
class _Plan:
    decode: _DecodeGroup | None
    extends: list[_ExtendItem]


def plan_attention(batch: ForwardBatch) -> _Plan:
    """Precompute slot gathers and masks once per forward (shared by all layers)."""
    ps = batch.page_size
    device = batch.input_ids.device
    decode_idx = [i for i, e in enumerate(batch.extend_lens_cpu) if e == 1]
    decode = None
    if decode_idx:
        lens = [batch.seq_lens_cpu[i] for i in decode_idx]
        max_len = max(lens)
        npages = (max_len + ps - 1) // ps
        idx = torch.tensor(decode_idx, device=device)
        pages = batch.page_table[idx, :npages].to(torch.int64)  # [Bd, npages]
        offs = torch.arange(ps, device=device)
        slots = (pages[:, :, None] * ps + offs).reshape(len(decode_idx), -1)[:, :max_len]
        lens_t = torch.tensor(lens, device=device)
        mask = torch.arange(max_len, device=device)[None, :] < lens_t[:, None]  # [Bd, L]
        slots = torch.where(mask, slots, torch.zeros_like(slots))
        rows = batch.qo_indptr[:-1][idx].to(torch.int64)
        decode = _DecodeGroup(rows=rows, slots=slots, mask=mask[:, None, None, :])
    extends = []
    indptr = 0
    for i, (e, seq_len) in enumerate(zip(batch.extend_lens_cpu, batch.seq_lens_cpu)):
        if e > 1:
            prefix = seq_len - e
            slots = page_slots(batch.page_table[i], seq_len, ps)
            mask = None
            if prefix > 0:
                q_pos = torch.arange(prefix, seq_len, device=device)[:, None]
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos  # [e, seq_len]
            extends.append(_ExtendItem(start=indptr, end=indptr + e, slots=slots, mask=mask))
        indptr += e
    return _Plan(decode=decode, extends=extends)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    plan: _Plan,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of the new tokens over their sequences' cached K/V (already stored)."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_buf.shape[1]
    if plan.decode is not None:
        d = plan.decode
        qd = q[d.rows][:, :, None, :]  # [Bd, Hq, 1, D]
        kd = k_buf[d.slots].transpose(1, 2).to(q.dtype)  # [Bd, Hkv, L, D]
        vd = v_buf[d.slots].transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=d.mask, scale=scale, enable_gqa=gqa
        )  # [Bd, Hq, 1, D]
        out[d.rows] = od[:, :, 0, :]
    for item in plan.extends:
        qe = q[item.start : item.end].transpose(0, 1)[None]  # [1, Hq, e, D]
        ke = k_buf[item.slots].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, L, D]
        ve = v_buf[item.slots].transpose(0, 1)[None].to(q.dtype)
        if item.mask is None:
            oe = F.scaled_dot_product_attention(
                qe, ke, ve, is_causal=True, scale=scale, enable_gqa=gqa
            )
        else:
            oe = F.scaled_dot_product_attention(
                qe, ke, ve, attn_mask=item.mask, scale=scale, enable_gqa=gqa
            )
        out[item.start : item.end] = oe[0].transpose(0, 1)
    return out


@register_attention_backend("torch")
class TorchAttentionBackend:
    """Reference backend: SDPA over K/V gathered through the page table."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self._plan: _Plan | None = None

    def init_forward(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._plan = plan_attention(batch)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        assert self._plan is not None, "init_forward() must be called before forward()"
        k_buf = self.kv_cache.k_buffers[layer_id]
        v_buf = self.kv_cache.v_buffers[layer_id]
        store_kv(k_buf, v_buf, self._batch.out_cache_loc, k, v)
        return paged_attention(q, k_buf, v_buf, self._plan, scale)
