"""Triton extend attention (new tokens over a paged prefix, causal among themselves), and the
whole `TritonAttentionBackend` on mixed decode + extend batches, against the torch twin and
dense SDPA. On CPU it runs in Triton's interpreter (see conftest): shapes are tiny."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.extend_attention import extend_attention
from radixlm.kernels.forward_batch import KVCache
from radixlm.kernels.reference import TorchAttentionBackend
from radixlm.kernels.triton_backend import TritonAttentionBackend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (prefix, new): no prefix; prefix off a page boundary; a chunk longer than one 16-row q block;
# a one-token extend; a prefix longer than one 16-token K/V block.
EXTEND_SHAPES = [(0, 5), (7, 3), (5, 18), (9, 1), (17, 4)]

CASES = [
    # (hq, hkv, page_size, dtype, d, layout)
    (4, 4, 1, torch.float32, 16, "table"),
    (6, 2, 4, torch.float16, 32, "csr"),
    (8, 1, 16, torch.bfloat16, 16, "table"),
    (6, 2, 16, torch.float32, 128, "csr"),
    (8, 1, 1, torch.float16, 16, "csr"),
    (4, 4, 4, torch.bfloat16, 96, "table"),
]


def run_extend(case, layout: str, scale: float) -> torch.Tensor:
    """NOTE: the new tokens are not stored first: the kernel must read them from k/v (the cache
    slots hold junk), as documented."""
    kv_indptr, kv_indices = case.table() if layout == "table" else case.csr()
    o = torch.zeros_like(case.q)
    ids = torch.arange(len(case.shapes), dtype=torch.int32, device=case.q.device)
    return extend_attention(
        case.q,
        case.k_new,
        case.v_new,
        o,
        case.k_buf,
        case.v_buf,
        ids,
        case.batch.qo_indptr,
        case.batch.prefix_lens,
        kv_indptr,
        kv_indices,
        case.cache.page_size,
        scale,
        max(n for _, n in case.shapes),
    )


@pytest.mark.parametrize("hq,hkv,page_size,dtype,d,layout", CASES)
def test_extend_matches_twin_and_dense(paged_case, hq, hkv, page_size, dtype, d, layout):
    case = paged_case(EXTEND_SHAPES, hq, hkv, d, page_size, dtype, seed=hq * 5 + page_size)
    scale = d**-0.5
    twin = case.torch_twin(scale)
    out = run_extend(case, layout, scale)
    tol = case.tol()
    torch.testing.assert_close(out.float(), case.dense_reference(scale), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), twin.float(), atol=tol, rtol=tol)


def test_extend_launcher_checks(paged_case):
    case = paged_case(EXTEND_SHAPES[:2], 4, 2, 16, 4, torch.float32)
    kv_indptr, kv_indices = case.table()
    ids = torch.arange(2, dtype=torch.int32, device=case.q.device)
    b = case.batch
    idx = (ids, b.qo_indptr, b.prefix_lens, kv_indptr, kv_indices, 4, 0.25, 5)
    o = torch.empty_like(case.q)
    k_strided = torch.zeros(case.k_new.shape[:2] + (32,), device=case.q.device)[..., ::2]
    with pytest.raises(ValueError, match="contiguous"):
        extend_attention(case.q, k_strided, case.v_new, o, case.k_buf, case.v_buf, *idx)
    with pytest.raises(ValueError, match="shape"):
        extend_attention(case.q, case.k_new[:-1], case.v_new, o, case.k_buf, case.v_buf, *idx)
    with pytest.raises(ValueError, match="qo_indptr"):
        bad = (ids, b.qo_indptr[:-1], b.prefix_lens, kv_indptr, kv_indices, 4, 0.25, 5)
        extend_attention(case.q, case.k_new, case.v_new, o, case.k_buf, case.v_buf, *bad)


# A ragged mixed batch as the scheduler builds it: decodes, a fresh prompt, a chunk over a cached
# prefix, a decode at a page boundary, a one-token prompt.
MIXED_SHAPES = [(6, 1), (0, 7), (9, 5), (16, 1), (0, 1), (3, 17)]


@pytest.mark.parametrize(
    "hq,hkv,page_size,splits,dtype",
    [(4, 2, 4, None, torch.float32), (6, 2, 1, 2, torch.float32), (8, 1, 16, 3, torch.float16)],
)
def test_backend_mixed_batch_matches_torch_backend(paged_case, hq, hkv, page_size, splits, dtype):
    """`TritonAttentionBackend` (store + decode + extend launches) vs the torch backend on one
    ragged batch: same outputs and the same cache contents afterwards. The plan is made once and
    used by two `forward` calls (as by two layers), the second with other queries."""
    d = 16
    scale = d**-0.5
    case = paged_case(MIXED_SHAPES, hq, hkv, d, page_size, dtype, seed=hq + page_size)
    cache_tri = KVCache([case.k_buf.clone()], [case.v_buf.clone()], page_size)
    cache_ref = KVCache([case.k_buf.clone()], [case.v_buf.clone()], page_size)
    tri = TritonAttentionBackend(cache_tri)
    tri.force_num_kv_splits = splits
    ref = TorchAttentionBackend(cache_ref)
    tri.init_forward(case.batch)
    ref.init_forward(case.batch)
    assert tri.decode_ids.tolist() == [0, 3, 4] and tri.extend_ids.tolist() == [1, 2, 5]
    tol = case.tol()
    for q in (case.q, torch.randn_like(case.q)):
        out = tri.forward(0, q, case.k_new, case.v_new, scale)
        expected = ref.forward(0, q, case.k_new, case.v_new, scale)
        torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(cache_tri.k_buffers[0], cache_ref.k_buffers[0], atol=0, rtol=0)
    torch.testing.assert_close(cache_tri.v_buffers[0], cache_ref.v_buffers[0], atol=0, rtol=0)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "hq,hkv,d,page_size",
    [(32, 8, 128, 16), (16, 16, 64, 1), (12, 2, 80, 64), (32, 4, 128, 64), (8, 1, 64, 16)],
)
def test_extend_cuda_large(paged_case, dtype, hq, hkv, d, page_size):
    shapes = [(0, 300), (77, 129), (1024, 64), (500, 1), (16, 511)]
    case = paged_case(shapes, hq, hkv, d, page_size, dtype, seed=d)
    scale = d**-0.5
    out = run_extend(case, "table", scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), case.dense_reference(scale), atol=tol, rtol=tol)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 64])
def test_extend_cuda_long_context(paged_case, page_size):
    """A 1k chunk over a 16k cached prefix, and a 4k prompt from scratch (GQA 8, head dim 128)."""
    shapes = [(16384, 1024), (0, 4096), (31000, 7)]
    case = paged_case(shapes, 32, 4, 128, page_size, torch.bfloat16, seed=page_size)
    scale = 128**-0.5
    out = run_extend(case, "csr", scale)
    torch.testing.assert_close(out.float(), case.dense_reference(scale), atol=2e-2, rtol=2e-2)
