"""Pure-torch paged attention: the CPU path and the oracle that every kernel is tested against.

Semantics (see `radixlm.kernels.forward_batch`): request `i`'s new tokens (rows
`qo_indptr[i]:qo_indptr[i+1]`) sit at positions `prefix_lens[i]..seq_lens[i]-1`; each attends to
every cached token of its own sequence at a position <= its own. K/V of the new tokens are first
scattered into their slots, then read back through the page table with the prefix.

A sliding-window layer (`window` W > 0) sees only keys at positions `p - W < j <= p` (the query
and the W - 1 before it; transformers' `sliding_window` mask). `softcap` > 0 caps the scaled
logits as `softcap * tanh(s / softcap)` before the mask (Gemma 2 / 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.kernels.forward_batch import ForwardBatch, KVCache, flat_from_pairs16
from radixlm.kernels.registry import register_attention_backend


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


# Decode requests are sorted by length and attended in groups of at most this many, so padding
# to the group's longest sequence stays small.
DECODE_GROUP_SIZE = 16


def gather_pages(
    buf: torch.Tensor, pages: torch.Tensor, page_size: int, kind: str = "k", layout: str = "flat"
) -> torch.Tensor:
    """Rows of whole pages: `buf` [S, Hkv, D], `pages` [B, P] -> [B, P * page_size, Hkv, D]
    (a `pairs16` buffer's pages are converted to rows; `kind` "k" or "v" says which).

    NOTE: page-granular `index_select` copies contiguous runs of `page_size` rows; it is ~3x
    faster on CPU than gathering token slots one by one.
    """
    b, p = pages.shape
    flat = buf.view(buf.shape[0] // page_size, -1)  # [num_pages, page_size * Hkv * D]
    out = torch.index_select(flat, 0, pages.reshape(-1)).view(-1, *buf.shape[1:])
    if layout == "pairs16":
        out = flat_from_pairs16(out, kind)
    return out.view(b, p * page_size, *buf.shape[1:])


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [b] rows of q (one per request)
    pages: torch.Tensor  # [b, P] int64 page ids (padding: page 0, masked out)
    mask: torch.Tensor  # [b, 1, 1, P * page_size] bool, True = attend


@dataclass
class _ExtendItem:
    start: int
    end: int
    seq_len: int
    pages: torch.Tensor  # [1, P] int64
    mask: torch.Tensor | None  # [e, seq_len] bool; None when causal from position 0


@dataclass
class _Plan:
    decode: list[_DecodeGroup]
    extends: list[_ExtendItem]
    page_size: int


def plan_attention(batch: ForwardBatch, window: int = 0) -> _Plan:
    """Precompute page gathers and masks once per forward (shared by all layers of one
    `window`; 0: full attention)."""
    ps = batch.page_size
    device = batch.input_ids.device
    lens = batch.seq_lens_cpu
    starts = [0]
    for e in batch.extend_lens_cpu:
        starts.append(starts[-1] + e)
    decode_idx = sorted(
        (i for i, e in enumerate(batch.extend_lens_cpu) if e == 1), key=lambda i: lens[i]
    )
    groups = []
    for g in range(0, len(decode_idx), DECODE_GROUP_SIZE):
        idx = decode_idx[g : g + DECODE_GROUP_SIZE]
        npages = -(-max(lens[i] for i in idx) // ps)
        idx_t = torch.tensor(idx, device=device)
        pages = batch.page_table[idx_t, :npages].to(torch.int64)  # [b, P]
        lens_t = torch.tensor([lens[i] for i in idx], device=device)
        cols = torch.arange(npages * ps, device=device)[None, :]
        mask = cols < lens_t[:, None]  # [b, L]
        if window:
            mask &= cols >= lens_t[:, None] - window
        rows = torch.tensor([starts[i] for i in idx], device=device)
        groups.append(_DecodeGroup(rows=rows, pages=pages, mask=mask[:, None, None, :]))
    extends = []
    for i, (e, seq_len) in enumerate(zip(batch.extend_lens_cpu, lens)):
        if e > 1:
            prefix = seq_len - e
            npages = -(-seq_len // ps)
            pages = batch.page_table[i : i + 1, :npages].to(torch.int64)
            mask = None
            if prefix > 0 or 0 < window < seq_len:
                q_pos = torch.arange(prefix, seq_len, device=device)[:, None]
                k_pos = torch.arange(seq_len, device=device)[None, :]
                mask = k_pos <= q_pos  # [e, seq_len]
                if window:
                    mask &= k_pos > q_pos - window
            extends.append(_ExtendItem(starts[i], starts[i] + e, seq_len, pages, mask))
    return _Plan(decode=groups, extends=extends, page_size=ps)


def sdpa(
    q: torch.Tensor,  # [b, Hq, e, D]
    k: torch.Tensor,  # [b, Hkv, L, D]
    v: torch.Tensor,  # [b, Hkv, L, D]
    mask: torch.Tensor | None,  # [.., e, L] bool, True = attend; None: causal from position 0
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:  # [b, Hq, e, D]
    """SDPA with GQA; with `softcap`, the explicit softmax of transformers' eager attention."""
    gqa = q.shape[1] != k.shape[1]
    if not softcap:
        causal = mask is None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(2, 3)) * scale  # [b, Hq, e, L]
    s = softcap_ref(s, softcap)
    if mask is None:
        e, n = s.shape[-2:]
        mask = torch.ones(e, n, dtype=torch.bool, device=s.device).tril(n - e)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_buf: torch.Tensor,  # [S, Hkv, D]
    v_buf: torch.Tensor,  # [S, Hkv, D]
    plan: _Plan,
    scale: float,
    softcap: float = 0.0,
    layout: str = "flat",
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of the new tokens over their sequences' cached K/V (already stored)."""
    out = torch.empty_like(q)
    ps = plan.page_size

    def gather(buf: torch.Tensor, pages: torch.Tensor, kind: str) -> torch.Tensor:
        return gather_pages(buf, pages, ps, kind, layout)

    for d in plan.decode:
        qd = q[d.rows][:, :, None, :]  # [b, Hq, 1, D]
        kd = gather(k_buf, d.pages, "k").transpose(1, 2).to(q.dtype)  # [b, Hkv, L, D]
        vd = gather(v_buf, d.pages, "v").transpose(1, 2).to(q.dtype)
        od = sdpa(qd, kd, vd, d.mask, scale, softcap)  # [b, Hq, 1, D]
        out[d.rows] = od[:, :, 0, :]
    for item in plan.extends:
        qe = q[item.start : item.end].transpose(0, 1)[None]  # [1, Hq, e, D]
        ke = gather(k_buf, item.pages, "k")[:, : item.seq_len].transpose(1, 2).to(q.dtype)
        ve = gather(v_buf, item.pages, "v")[:, : item.seq_len].transpose(1, 2).to(q.dtype)
        oe = sdpa(qe, ke, ve, item.mask, scale, softcap)
        out[item.start : item.end] = oe[0].transpose(0, 1)
    return out


@register_attention_backend("torch")
class TorchAttentionBackend:
    """Reference backend: SDPA over K/V gathered through the page table."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self._plans: dict[int, _Plan] = {}

    def init_forward(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._plans = {0: plan_attention(batch)}  # windowed plans: on a layer's first use

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [T, Hq, D]
        assert self._plans, "init_forward() must be called before forward()"
        plan = self._plans.get(window)
        if plan is None:
            plan = self._plans[window] = plan_attention(self._batch, window)
        cache = self.kv_cache
        k_buf = cache.k_buffers[layer_id]
        v_buf = cache.v_buffers[layer_id]
        if cache.layout == "flat":
            store_kv(k_buf, v_buf, self._batch.out_cache_loc, k, v)
        else:
            cache.write_rows(layer_id, "k", self._batch.out_cache_loc, k)
            cache.write_rows(layer_id, "v", self._batch.out_cache_loc, v)
        return paged_attention(q, k_buf, v_buf, plan, scale, softcap, cache.layout)


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H], updated in place to x + residual
) -> torch.Tensor:  # [T, H]
    """Twin of `fused_ops.rms_norm`; the numerics of `models.llama.RMSNorm` (fp32 statistics,
    cast to the input dtype, then the weight multiply), with the residual add rounded to the
    input dtype first when given."""
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_ref(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [P, D]
    sin: torch.Tensor,  # [P, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `fused_ops.apply_rope`: neox rotate-half, as `models.llama.RotaryEmbedding`."""
    c = cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
    s = sin[positions].to(q.dtype)[:, None, :]
    half = q.shape[-1] // 2

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """Twin of the CPU `silu_and_mul`: `silu(gate) * up` for `x = [gate | up]`, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """GeGLU (Gemma): `gelu_tanh(gate) * up` for `x = [gate | up]`, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def softcap_ref(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`cap * tanh(x / cap)` (Gemma's final logit soft-capping)."""
    return torch.tanh(x / cap) * cap
