"""Sliding-window attention (a query at position p sees keys p - W < j <= p) in every backend
against dense SDPA with a window mask: the torch twin, the compiled CPU op (per-row masks in
extend blocks, split-KV decode within the window, bf16) and the Triton decode / extend kernels
(Triton's interpreter on CPU); soft-capped logits in the twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.kernels.cpu import build
from radixlm.kernels.forward_batch import KVCache
from radixlm.kernels.registry import create_attention_backend
from radixlm.radix import HybridBlockPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)

# (prefix, new): decode rows inside / across the window, extends with prefix 0 and > 0 whose
# rows cross the window, an extend of 1 + block rows (a one-row work item)
SHAPES = [(0, 1), (5, 1), (40, 1), (0, 23), (9, 14), (30, 5), (3, 17), (60, 1)]
SCALE = 0.25


def run_backend(case, name: str, window: int, splits: int | None = None, **attrs):
    cache = KVCache([case.k_buf.clone()], [case.v_buf.clone()], case.cache.page_size)
    backend = create_attention_backend(name, cache)
    if splits is not None:
        backend.force_num_kv_splits = splits
    for key, value in attrs.items():
        setattr(backend, key, value)
    backend.init_forward(case.batch)
    return backend.forward(0, case.q, case.k_new, case.v_new, SCALE, window)


@pytest.mark.parametrize("window", [1, 4, 8, 100])
def test_torch_twin_matches_dense(paged_case, window):
    case = paged_case(SHAPES, 4, 2, 16, 4, torch.float32, seed=window, device="cpu")
    out = case.torch_twin(SCALE, window)
    torch.testing.assert_close(out, case.dense_reference(SCALE, window), atol=2e-5, rtol=2e-5)
    if window < 40:  # the window changes the answer
        assert not torch.allclose(out, case.dense_reference(SCALE), atol=1e-3)


@pytest.mark.skipif(build.load_op() is None, reason="CPU op unavailable")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_cpu_op_matches_dense(paged_case, dtype, window, splits):
    case = paged_case(SHAPES, 8, 2, 32, 4, dtype, seed=window + splits, device="cpu")
    out = run_backend(case, "cpu", window, splits, extend_block=16)
    tol = case.tol()
    torch.testing.assert_close(out.float(), case.dense_reference(SCALE, window), atol=tol, rtol=tol)
    # the full-attention plan of the same forward is unaffected
    full = run_backend(case, "cpu", 0, splits, extend_block=16)
    torch.testing.assert_close(full.float(), case.dense_reference(SCALE), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [3, 8])
@pytest.mark.parametrize("splits", [1, 2])
def test_triton_matches_dense(paged_case, window, splits):
    case = paged_case(SHAPES, 4, 2, 16, 4, torch.float32, seed=window * splits)
    out = run_backend(case, "triton", window, splits)
    torch.testing.assert_close(
        out.float().cpu(), case.dense_reference(SCALE, window).cpu(), atol=2e-5, rtol=2e-5
    )


def test_softcap_in_the_twin(paged_case):
    case = paged_case([(0, 6), (5, 1)], 4, 2, 16, 4, torch.float32, seed=1, device="cpu")
    cap = 0.5
    cache = KVCache([case.k_buf.clone()], [case.v_buf.clone()], case.cache.page_size)
    backend = create_attention_backend("torch", cache)
    backend.init_forward(case.batch)
    out = backend.forward(0, case.q, case.k_new, case.v_new, SCALE, 0, cap)
    want, row = [], 0
    for (prefix, new), k, v in zip(case.shapes, case.k_seq, case.v_seq):
        q = case.q[row : row + new].transpose(0, 1)  # [Hq, new, D]
        kk = k.repeat_interleave(2, dim=1).transpose(0, 1)  # [Hq, L, D]
        vv = v.repeat_interleave(2, dim=1).transpose(0, 1)
        s = torch.tanh(q @ kk.transpose(1, 2) * SCALE / cap) * cap  # [Hq, new, L]
        pos = prefix + torch.arange(new)[:, None]
        s = s.masked_fill(torch.arange(prefix + new)[None, :] > pos, float("-inf"))
        want.append((F.softmax(s, dim=-1) @ vv).transpose(0, 1))
        row += new
    torch.testing.assert_close(out, torch.cat(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("hybrid", [False, True])
def test_gemma3_on_triton_matches_transformers(make_tiny_model, hybrid):
    """A tiny Gemma 3 (sliding layers of window 5 around a global one) through the Triton
    kernels: chunked prefill over the paged prefix and decode steps, logits vs transformers.
    `hybrid`: the sliding layers' K/V in their own pages (`HybridBlockPool`), those outside the
    window released after each step."""
    from transformers import AutoModelForCausalLM

    from radixlm.config import CacheConfig
    from radixlm.kernels.forward_batch import ForwardBatch
    from radixlm.runtime.model_runner import ModelRunner

    model_dir = make_tiny_model(
        "gemma3_text", seed=31, num_hidden_layers=3, head_dim=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    ids = [(i * 7919) % 40000 + 5 for i in range(19)]
    runner = ModelRunner(
        model_dir, "float32", torch.device(DEVICE),
        CacheConfig(page_size=4, num_pages=8, swa_full_tokens_ratio=0.5),
        attention_backend="triton", hybrid_swa=hybrid,
    )  # fmt: skip
    pool = None
    if hybrid:
        pool = HybridBlockPool(runner.num_pages, runner.num_swa_pages, 4, runner.swa_window)
        runner.bind_swa_map(pool.swa_map)
    pages: list[int] = []
    outs, start, released = [], 0, 0
    for n in (9, 7, 1, 1, 1):  # two prefill chunks, then three decode steps
        need = -(-(start + n) // 4)
        pages += pool.alloc(need - len(pages)) if pool else range(len(pages), need)
        batch = ForwardBatch.build(
            [ids[start : start + n]], [start], [pages], [list(range(n))], 4, DEVICE
        )
        outs.append(runner.forward(batch).cpu())
        start += n
        if pool is not None:  # 4 window pages for 5 pages of tokens: only with releases
            first = pool.first_needed_page(start)
            pool.decref_swa(pages[released:first])
            released = first
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(torch.cat(outs), want, atol=2e-4, rtol=1e-4)
