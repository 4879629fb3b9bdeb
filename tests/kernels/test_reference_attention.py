"""The torch paged-attention twin against dense `scaled_dot_product_attention`."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.forward_batch import ForwardBatch, KVCache
from radixlm.kernels.reference import TorchAttentionBackend


def dense_reference(q, k, v, prefix: int, scale: float) -> torch.Tensor:
    """q [e, Hq, D] for positions prefix..prefix+e-1; k, v [L, Hkv, D] for positions 0..L-1."""
    e, hq, _ = q.shape
    L, hkv, _ = k.shape
    rep = hq // hkv
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, L, D]
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    mask = torch.arange(L)[None, :] <= (prefix + torch.arange(e))[:, None]  # [e, L]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense(page_size, hq, hkv, dtype):
    rng = random.Random(page_size * 100 + hq * 10 + hkv)
    torch.manual_seed(rng.randrange(1 << 30))
    d = 16
    # (prefix, new) per request: decode, extend with no prefix, extend over a ragged prefix.
    shapes = [(0, 5), (7, 1), (13, 6), (page_size * 2, 1), (3, 3), (0, 1)]
    num_pages = sum(-(-(p + e) // page_size) for p, e in shapes) + 3
    cache = KVCache.allocate(1, num_pages, page_size, hkv, d, dtype, "cpu")
    free = list(range(num_pages))
    rng.shuffle(free)  # pages scattered in the pool
    seqs = []
    for prefix, new in shapes:
        L = prefix + new
        pages = [free.pop() for _ in range(-(-L // page_size))]
        k = torch.randn(L, hkv, d, dtype=dtype)
        v = torch.randn(L, hkv, d, dtype=dtype)
        q = torch.randn(new, hq, d, dtype=dtype)
        for pos in range(prefix):  # the cached prefix is already in its pages
            slot = pages[pos // page_size] * page_size + pos % page_size
            cache.k_buffers[0][slot] = k[pos]
            cache.v_buffers[0][slot] = v[pos]
        seqs.append((prefix, new, pages, q, k, v))
    batch = ForwardBatch.build(
        [[1] * new for _, new, *_ in seqs],
        [p for p, *_ in seqs],
        [pages for _, _, pages, *_ in seqs],
        [[] for _ in seqs],
        page_size,
        "cpu",
    )
    backend = TorchAttentionBackend(cache)
    backend.init_forward(batch)
    q_all = torch.cat([s[3] for s in seqs])
    k_new = torch.cat([s[4][s[0] :] for s in seqs])
    v_new = torch.cat([s[5][s[0] :] for s in seqs])
    out = backend.forward(0, q_all, k_new, v_new, scale=d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for prefix, new, _, q, k, v in seqs:
        ref = dense_reference(q.float(), k.float(), v.float(), prefix, d**-0.5)
        torch.testing.assert_close(out[row : row + new].float(), ref, atol=tol, rtol=tol)
        row += new
    # The new K/V landed in their page slots.
    for prefix, new, pages, _, k, _ in seqs:
        for pos in range(prefix + new):
            slot = pages[pos // page_size] * page_size + pos % page_size
            torch.testing.assert_close(cache.k_buffers[0][slot], k[pos])


def test_copy_pages_copies_every_layer():
    cache = KVCache.allocate(2, 4, 2, 1, 3, torch.float32, "cpu")
    for buf in (*cache.k_buffers, *cache.v_buffers):
        buf.copy_(torch.randn_like(buf))
    cache.copy_pages([1], [3])
    for buf in (*cache.k_buffers, *cache.v_buffers):
        torch.testing.assert_close(buf[6:8], buf[2:4])
