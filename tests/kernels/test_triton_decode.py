"""Triton paged decode attention (single pass and split-KV + reduce) against the torch twin and
dense SDPA. On CPU it runs in Triton's interpreter (see conftest): shapes are tiny."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels.attention import pages_to_csr
from radixlm.kernels.decode_attention import decode_attention
from radixlm.kernels.triton_backend import choose_num_kv_splits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Decode rows: (prefix, 1). Ragged: a request with an empty prefix (kv length 1), lengths on and
# off page boundaries, one longer than a 16-token block.
DECODE_SHAPES = [(0, 1), (4, 1), (12, 1), (19, 1)]

# Pairwise cover of GQA ratio x page size x dtype x head dim x splits x index layout.
CASES = [
    # (hq, hkv, page_size, dtype, d, num_kv_splits, layout)
    (4, 4, 1, torch.float32, 16, 1, "table"),
    (6, 2, 4, torch.float16, 32, 3, "csr"),
    (8, 1, 16, torch.bfloat16, 16, 1, "csr"),
    (4, 4, 16, torch.float16, 16, 3, "table"),
    (6, 2, 1, torch.bfloat16, 16, 3, "table"),
    (8, 1, 4, torch.float32, 80, 2, "table"),
]


def run_decode(case, num_kv_splits: int, layout: str, scale: float) -> torch.Tensor:
    case.store_new()  # the decode kernel reads the query token's own K/V from the cache
    if layout == "table":
        kv_indptr, kv_indices = case.table()
    else:  # the runtime's CSR helper, checked against the pages the case drew
        b = case.batch
        kv_indptr, kv_indices = pages_to_csr(b.page_table, b.seq_lens_cpu, b.page_size)
        for got, want in zip((kv_indptr, kv_indices), case.csr()):
            assert torch.equal(got, want)
    b = len(case.shapes)
    o = torch.zeros_like(case.q)
    ids = torch.arange(b, dtype=torch.int32, device=case.q.device)
    return decode_attention(
        case.q,
        case.k_buf,
        case.v_buf,
        o,
        ids,
        case.batch.qo_indptr[:-1],
        case.batch.seq_lens,
        kv_indptr,
        kv_indices,
        case.cache.page_size,
        scale,
        num_kv_splits,
    )


@pytest.mark.parametrize("hq,hkv,page_size,dtype,d,splits,layout", CASES)
def test_decode_matches_twin_and_dense(paged_case, hq, hkv, page_size, dtype, d, splits, layout):
    case = paged_case(DECODE_SHAPES, hq, hkv, d, page_size, dtype, seed=hq * 7 + page_size)
    scale = d**-0.5
    twin = case.torch_twin(scale)
    out = run_decode(case, splits, layout, scale)
    tol = case.tol()
    torch.testing.assert_close(out.float(), case.dense_reference(scale), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), twin.float(), atol=tol, rtol=tol)


def test_decode_subset_of_requests_leaves_other_rows(paged_case):
    """`req_ids` selects requests; rows of the others are untouched (mixed batches rely on it)."""
    case = paged_case(DECODE_SHAPES, 4, 2, 16, 4, torch.float32, seed=3)
    case.store_new()
    kv_indptr, kv_indices = case.table()
    o = torch.full_like(case.q, 7.0)
    ids = torch.tensor([1, 3], dtype=torch.int32, device=case.q.device)
    decode_attention(
        case.q, case.k_buf, case.v_buf, o, ids, case.batch.qo_indptr[:-1],
        case.batch.seq_lens, kv_indptr, kv_indices, 4, 0.25, 2,
    )  # fmt: skip
    ref = case.dense_reference(0.25)
    torch.testing.assert_close(o[[1, 3]], ref[[1, 3]], atol=2e-5, rtol=2e-5)
    assert torch.all(o[[0, 2]] == 7.0)


def test_decode_launcher_checks(paged_case):
    case = paged_case(DECODE_SHAPES[:2], 4, 2, 16, 4, torch.float32)
    kv_indptr, kv_indices = case.table()
    ids = torch.arange(2, dtype=torch.int32, device=case.q.device)
    args = (ids, case.batch.qo_indptr[:-1], case.batch.seq_lens, kv_indptr, kv_indices, 4, 0.25)
    q_strided = torch.zeros(2, 4, 32, device=case.q.device)[:, :, ::2]  # last dim stride 2
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q_strided, case.k_buf, case.v_buf, torch.empty_like(case.q), *args)
    q3 = torch.zeros(2, 3, 16, device=case.q.device)  # 3 q heads over 2 kv heads
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q3, case.k_buf, case.v_buf, torch.empty_like(q3), *args)
    with pytest.raises(ValueError, match="kv_indptr"):
        bad = (ids, case.batch.qo_indptr[:-1], case.batch.seq_lens, kv_indptr[:2], kv_indices)
        decode_attention(case.q, case.k_buf, case.v_buf, torch.empty_like(case.q), *bad, 4, 0.25)
    with pytest.raises(TypeError):
        decode_attention(case.q.long(), case.k_buf, case.v_buf, case.q.long(), *args)


def test_split_heuristic():
    # Batch 64 x 8 KV heads fills an H100 (132 SMs) without splitting.
    assert choose_num_kv_splits(64, 8, 4096, 132) == 1
    # One long request splits, bounded by max_splits and by the minimum split length.
    assert choose_num_kv_splits(1, 8, 4096, 132) == 16
    assert choose_num_kv_splits(1, 8, 4096, 132, max_splits=4) == 4
    assert choose_num_kv_splits(1, 8, 600, 132) == 2
    assert choose_num_kv_splits(2, 8, 100, 132) == 1
    assert choose_num_kv_splits(0, 8, 4096, 132) == 1


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "hq,hkv,d,page_size", [(32, 8, 128, 16), (32, 32, 64, 1), (28, 4, 128, 64), (32, 4, 128, 1)]
)
@pytest.mark.parametrize("splits", [1, 8])
def test_decode_cuda_large(paged_case, dtype, hq, hkv, d, page_size, splits):
    shapes = [(n, 1) for n in (0, 31, 255, 1000, 2047, 513, 64, 1)]
    case = paged_case(shapes, hq, hkv, d, page_size, dtype, seed=d + page_size)
    scale = d**-0.5
    out = run_decode(case, splits, "csr" if splits > 1 else "table", scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), case.dense_reference(scale), atol=tol, rtol=tol)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 16, 64])
def test_decode_cuda_long_context(paged_case, splits):
    """Contexts up to 32k tokens (GQA 8, head dim 128, bf16), one split and split-KV."""
    shapes = [(32767, 1), (20000, 1), (4095, 1), (3, 1)]
    case = paged_case(shapes, 32, 4, 128, 16, torch.bfloat16, seed=splits)
    scale = 128**-0.5
    out = run_decode(case, splits, "csr", scale)
    torch.testing.assert_close(out.float(), case.dense_reference(scale), atol=2e-2, rtol=2e-2)
