"""Triton KV store (scatter new K/V into page slots) against the torch twin `store_kv`."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.kernels.kv_store import store_kv
from radixlm.kernels.reference import store_kv as store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "num_tokens,page_size,hkv,d,src_dtype,buf_dtype,loc_dtype",
    [
        (9, 1, 1, 16, torch.float32, torch.float32, torch.int64),
        (13, 4, 3, 32, torch.float16, torch.float16, torch.int32),
        (5, 16, 8, 16, torch.bfloat16, torch.bfloat16, torch.int64),
        (7, 4, 2, 80, torch.float32, torch.bfloat16, torch.int64),  # cast on store
        (0, 4, 2, 16, torch.float32, torch.float32, torch.int64),  # empty batch
    ],
)
def test_store_matches_twin(num_tokens, page_size, hkv, d, src_dtype, buf_dtype, loc_dtype):
    gen = torch.Generator().manual_seed(num_tokens + d)
    num_slots = 8 * page_size + 32
    k_buf = torch.randn(num_slots, hkv, d, generator=gen).to(buf_dtype).to(DEVICE)
    v_buf = torch.randn(num_slots, hkv, d, generator=gen).to(buf_dtype).to(DEVICE)
    slots = random.Random(d).sample(range(num_slots), num_tokens)
    loc = torch.tensor(slots, dtype=loc_dtype, device=DEVICE)
    # K/V as the model makes them: views into a fused qkv row (token stride > Hkv * D).
    qkv = torch.randn(num_tokens, 3 * hkv * d, generator=gen).to(src_dtype).to(DEVICE)
    k = qkv[:, hkv * d : 2 * hkv * d].view(num_tokens, hkv, d)
    v = qkv[:, 2 * hkv * d :].view(num_tokens, hkv, d)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv_ref(k_ref, v_ref, loc.long(), k, v)
    store_kv(k_buf, v_buf, loc, k, v)
    torch.testing.assert_close(k_buf, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_buf, v_ref, atol=0, rtol=0)


def test_store_launcher_checks():
    k_buf = torch.zeros(16, 2, 16, device=DEVICE)
    v_buf = torch.zeros(16, 2, 16, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    loc = torch.arange(3, device=DEVICE)
    strided = torch.zeros(3, 2, 32, device=DEVICE)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(k_buf, v_buf, loc, strided, k)
    with pytest.raises(ValueError, match="shape"):
        store_kv(k_buf, v_buf, loc, torch.zeros(3, 1, 16, device=DEVICE), k)
    with pytest.raises(ValueError, match="out_cache_loc"):
        store_kv(k_buf, v_buf, loc[:2], k, k)
    with pytest.raises(ValueError, match="out_cache_loc"):
        store_kv(k_buf, v_buf, loc.float(), k, k)
    with pytest.raises(TypeError):
        store_kv(k_buf, v_buf, loc, k.long(), k.long())
