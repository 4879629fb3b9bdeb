"""Kernel-test fixtures: random paged KV caches with ragged requests, and their dense oracle.

Without CUDA the Triton kernels run in Triton's CPU interpreter: `TRITON_INTERPRET=1` is set here,
at import time, before any test module imports a kernel (Triton fixes interpreted vs compiled
when a kernel is decorated). The torch-only tests in this directory are unaffected by it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch.nn.functional as F

from radixlm.kernels.forward_batch import ForwardBatch, KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedCase:
    """`B` requests; request `i` has `prefix_i` tokens in the cache and `new_i` new tokens.

    The prefix K/V are already in their (shuffled) pages; the new tokens' K/V are only in
    `k_new`/`v_new` (rows in request order, like `q`), as before a forward's store.
    """

    shapes: list[tuple[int, int]]  # (prefix, new) per request
    cache: KVCache  # one layer
    batch: ForwardBatch
    pages: list[list[int]]
    q: torch.Tensor  # [T, Hq, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor  # [T, Hkv, D]
    k_seq: list[torch.Tensor]  # [L_i, Hkv, D] every position of request i
    v_seq: list[torch.Tensor]

    @property
    def k_buf(self) -> torch.Tensor:
        return self.cache.k_buffers[0]

    @property
    def v_buf(self) -> torch.Tensor:
        return self.cache.v_buffers[0]

    def store_new(self) -> None:
        """Scatter the new tokens' K/V into their slots (what a forward's store does)."""
        loc = self.batch.out_cache_loc
        self.k_buf[loc] = self.k_new.to(self.k_buf.dtype)
        self.v_buf[loc] = self.v_new.to(self.v_buf.dtype)

    def csr(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(kv_indptr, kv_indices)` packing only each request's pages (int32)."""
        indptr = [0]
        for p in self.pages:
            indptr.append(indptr[-1] + len(p))
        flat = [x for p in self.pages for x in p]
        dev = self.q.device
        return (
            torch.tensor(indptr, dtype=torch.int32, device=dev),
            torch.tensor(flat, dtype=torch.int32, device=dev),
        )

    def table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(kv_indptr, kv_indices)` from the batch's `[B, max_pages]` page table."""
        pt = self.batch.page_table
        indptr = torch.arange(pt.shape[0] + 1, dtype=torch.int32, device=pt.device)
        return indptr * pt.stride(0), pt.reshape(-1)

    def tol(self) -> float:
        """Abs/rel tolerance against fp32 references: the output's rounding (and, on GPU, the
        half-precision P @ V product)."""
        return tolerance(self.q.dtype)

    def torch_twin(self, scale: float, window: int = 0) -> torch.Tensor:  # [T, Hq, D]
        """`TorchAttentionBackend` (store + paged SDPA) on a copy of the cache."""
        from radixlm.kernels.reference import TorchAttentionBackend

        cache = KVCache([self.k_buf.clone()], [self.v_buf.clone()], self.cache.page_size)
        backend = TorchAttentionBackend(cache)
        backend.init_forward(self.batch)
        return backend.forward(0, self.q, self.k_new, self.v_new, scale, window)

    def dense_reference(self, scale: float, window: int = 0) -> torch.Tensor:  # [T, Hq, D] fp32
        """`scaled_dot_product_attention` on dense fp32 K/V per request (GQA by repeat); with
        `window` W, a query at position p sees keys p - W < j <= p."""
        outs = []
        row = 0
        for (prefix, new), k, v in zip(self.shapes, self.k_seq, self.v_seq):
            q = self.q[row : row + new].float()
            rep = q.shape[1] // k.shape[1]
            kk = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, L, D]
            vv = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
            L = prefix + new
            pos = prefix + torch.arange(new, device=q.device)
            keys = torch.arange(L, device=q.device)[None, :]
            mask = keys <= pos[:, None]  # [new, L]
            if window:
                mask &= keys > pos[:, None] - window
            qq = q.transpose(0, 1)  # [Hq, new, D]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
            outs.append(o.transpose(0, 1))
            row += new
        return torch.cat(outs)


def make_paged_case(
    shapes: list[tuple[int, int]],
    hq: int,
    hkv: int,
    d: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = DEVICE,
    groups: list[int] | None = None,
    shared_tokens: int = 0,
) -> PagedCase:
    """Random q/k/v for ragged requests; pages drawn at random from a pool with spare pages.

    `groups[i] >= 0` puts request i in a group whose members share their first
    `shared_tokens` positions (a multiple of `page_size`): the same physical pages holding the
    same K/V, as after a radix-cache prefix hit."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    assert shared_tokens % page_size == 0
    num_pages = sum(-(-(p + n) // page_size) for p, n in shapes) + 3
    cache = KVCache.allocate(1, num_pages, page_size, hkv, d, dtype, device)
    cache.k_buffers[0].copy_(torch.randn(cache.k_buffers[0].shape, generator=gen))  # junk
    cache.v_buffers[0].copy_(torch.randn(cache.v_buffers[0].shape, generator=gen))
    free = list(range(num_pages))
    rng.shuffle(free)
    pages, k_seq, v_seq, qs = [], [], [], []
    shared: dict[int, tuple[list[int], torch.Tensor, torch.Tensor]] = {}
    for i, (prefix, new) in enumerate(shapes):
        L = prefix + new
        pg = [free.pop() for _ in range(-(-L // page_size))]
        k = torch.randn(L, hkv, d, generator=gen).to(dtype).to(device)
        v = torch.randn(L, hkv, d, generator=gen).to(dtype).to(device)
        g = groups[i] if groups is not None else -1
        if g >= 0:
            assert prefix >= shared_tokens
            n_sh = shared_tokens // page_size
            if g not in shared:
                shared[g] = (pg[:n_sh], k[:shared_tokens], v[:shared_tokens])
            else:
                free.extend(pg[:n_sh])  # this member's own copies are not used
            pg[:n_sh] = shared[g][0]
            k[:shared_tokens] = shared[g][1]
            v[:shared_tokens] = shared[g][2]
        qs.append(torch.randn(new, hq, d, generator=gen).to(dtype).to(device))
        slots = torch.tensor([pg[j // page_size] * page_size + j % page_size for j in range(L)])
        slots = slots.to(device)
        cache.k_buffers[0][slots[:prefix]] = k[:prefix]
        cache.v_buffers[0][slots[:prefix]] = v[:prefix]
        pages.append(pg)
        k_seq.append(k)
        v_seq.append(v)
    batch = ForwardBatch.build(
        [[1] * new for _, new in shapes],
        [p for p, _ in shapes],
        pages,
        [[] for _ in shapes],
        page_size,
        device,
    )
    return PagedCase(
        shapes=shapes,
        cache=cache,
        batch=batch,
        pages=pages,
        q=torch.cat(qs),
        k_new=torch.cat([k[p:] for (p, _), k in zip(shapes, k_seq)]),
        v_new=torch.cat([v[p:] for (p, _), v in zip(shapes, v_seq)]),
        k_seq=k_seq,
        v_seq=v_seq,
    )


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


@pytest.fixture
def paged_case() -> Callable[..., PagedCase]:
    return make_paged_case


def _runner_logits(runner, chunks: tuple[int, ...], num_pages: int) -> torch.Tensor:
    """Logits of every position of one request fed to `runner.forward` in chunks of these
    sizes (prefill, extends over the paged prefix, decodes) on pages 0 .. num_pages - 1."""
    ids = [(i * 7919) % 40000 + 5 for i in range(sum(chunks))]
    pages = list(range(num_pages))
    outs, start = [], 0
    for n in chunks:
        batch = ForwardBatch.build(
            [ids[start : start + n]], [start], [pages], [list(range(n))], runner.page_size, "cpu"
        )
        outs.append(runner.forward(batch))
        start += n
    return torch.cat(outs)


@pytest.fixture
def runner_logits() -> Callable[..., torch.Tensor]:
    return _runner_logits
