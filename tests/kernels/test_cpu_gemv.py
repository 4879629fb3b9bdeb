"""The compiled bf16 GEMV for inputs of a few rows (`kernels/cpu/gemv.cpp`): against an fp32
product (one row and many-row tiles, input / output / column tails, bias), its batch
invariance, inside `PackedLinear` against the oneDNN path, the policy that keeps the plain
weights (`pack_linears(plain=...)`), and a model runner's logits with and without it (the
one-call layer stack passes the weights per layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.config import CacheConfig
from radixlm.runtime.models import cpu_linear
from radixlm.runtime.models.cpu_linear import PackedLinear, gemv_supported, pack_linears

pytestmark = pytest.mark.skipif(
    not gemv_supported(), reason="the bf16 GEMV needs the built op and AVX512_BF16"
)


@pytest.mark.parametrize("n,k", [(16, 64), (960, 576), (577, 100), (15, 33), (3, 1536)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 11, 17])
def test_gemv_matches_fp32_product(n, k, bias, m):
    gen = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = cpu_linear._gemv_op().gemv_bf16(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    # fp32 accumulation, one rounding to bf16
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("n,k", [(960, 576), (577, 100), (3, 33)])
def test_gemv_rows_do_not_depend_on_the_batch(n, k):
    """Each row's output is bit-identical whatever the other rows are: every tile shape runs the
    same per-output vdpbf16ps sequence and the same lane tree (batch invariance: a request's
    greedy tokens do not depend on how many others share its step, up to the crossover)."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    op = cpu_linear._gemv_op()
    for m in range(2, 18):
        x = torch.randn(m, k, generator=gen).bfloat16()
        alone = torch.cat([op.gemv_bf16(x[i : i + 1], w, b) for i in range(m)])
        assert torch.equal(op.gemv_bf16(x, w, b), alone), m


def test_gemv_of_no_rows_is_empty():
    """A step with no rows to project (a prefill chunk that wants no logits) gets [0, N]."""
    out = cpu_linear._gemv_op().gemv_bf16(
        torch.zeros(0, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), torch.zeros(4).bfloat16()
    )
    assert out.shape == (0, 4)
    lin = PackedLinear(nn.Linear(8, 4).to(torch.bfloat16), plain=True)
    assert lin(torch.zeros(0, 8).bfloat16()).shape == (0, 4)


def test_gemv_refuses_bad_shapes():
    op = cpu_linear._gemv_op()
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        op.gemv_bf16(torch.zeros(2, 3, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), None)
    with pytest.raises(RuntimeError, match=r"\[N, K\]"):
        op.gemv_bf16(torch.zeros(2, 8).bfloat16(), torch.zeros(4, 9).bfloat16(), None)
    with pytest.raises(RuntimeError, match="bf16"):
        op.gemv_bf16(torch.zeros(1, 8), torch.zeros(4, 8), None)


def test_packed_linear_few_rows_path_matches_onednn():
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    fast, slow = PackedLinear(lin, plain=True), PackedLinear(lin)
    assert fast.weight_plain is not None and slow.weight_plain is None
    most = cpu_linear.gemv_max_rows()
    assert most >= 1
    x = torch.randn(most + 1, 576).bfloat16()
    for rows in sorted({1, 3, most}):
        a, b = fast(x[:rows]), slow(x[:rows])
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2)
    assert torch.equal(fast(x), slow(x))  # past the crossover both take oneDNN


def test_pack_linears_keeps_plain_weights_only_for_small_models(monkeypatch):
    def model() -> nn.Module:
        m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64, bias=False))
        return m.to(torch.bfloat16)

    m = model()
    w0 = m[0].weight
    assert pack_linears(m, plain=True) == 2
    assert all(lin.weight_plain is not None for lin in m)
    assert m[0].weight_plain.data_ptr() == w0.data_ptr()  # kept, not copied
    monkeypatch.setattr(cpu_linear, "PLAIN_MAX_WEIGHT_BYTES", 100)
    m = model()
    pack_linears(m, plain=True)
    assert all(lin.weight_plain is None for lin in m)
    m = model()
    pack_linears(m)
    assert all(lin.weight_plain is None for lin in m)


def test_runner_logits_with_the_gemv(make_tiny_model, monkeypatch, runner_logits):
    """A bf16 runner's layer stack takes the GEMV for its one-row (decode) forwards; the logits
    of prefill, extend and decodes match a runner without it."""
    from radixlm.runtime import model_runner as mr

    model_dir = make_tiny_model("llama", 7, hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)  # fmt: skip
    logits = {}
    for on in (True, False):
        if not on:
            monkeypatch.setattr(cpu_linear, "gemv_supported", lambda: False)
        runner = mr.ModelRunner(
            model_dir, "bfloat16", torch.device("cpu"), CacheConfig(page_size=16, num_pages=8),
            attention_backend="cpu",
        )  # fmt: skip
        stack = runner.model.stack
        assert stack is not None and len(stack.plain) == (4 * 2 if on else 0)
        logits[on] = runner_logits(runner, (7, 20, 1, 1, 1), 4)
    torch.testing.assert_close(logits[True], logits[False], atol=5e-2, rtol=5e-2)


def test_bf16_engine_with_chunked_prefill_takes_the_gemv(make_tiny_model):
    """A bf16 engine whose prompts span several prefill chunks: the chunks that want no logits
    send 0 rows to the LM head (the GEMV returns [0, N]), the decode steps 1-3 rows; every
    request finishes with its tokens (a 0-row step once failed the whole batch)."""
    from radixlm import Engine, SamplingParams

    model_dir = make_tiny_model("llama", 11, hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)  # fmt: skip
    engine = Engine(
        str(model_dir), dtype="bfloat16", attention_backend="cpu", num_pages=64, page_size=16,
        chunked_prefill_size=16, num_threads=1, device="cpu",
    )  # fmt: skip
    with engine:
        assert any(
            getattr(m, "weight_plain", None) is not None for m in engine.runner.model.modules()
        )
        prompts = [[(i * 7919 + j) % 900 + 5 for i in range(40 + 9 * j)] for j in range(3)]
        params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
        outs = engine.generate(prompts, params)
    assert [len(o.outputs[0].output_token_ids) for o in outs] == [5, 5, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
