"""radixlm's packed linear on fp32 activations (`kernels/cpu/linear_bf16.cpp`, AVX2 + FMA): the
path CPUs without native bf16 take at every row count (they compute in fp32 on a bf16 weight
copy). Against a float64 product (row counts across the few-row passes, the 6-row blocks and the
row chunks of the blocked kernel; N / K tails, odd K, K blocks; bias), batch invariance across
both kernels, the gated epilogue against `silu_and_mul`, `PackedLinear` keeping no oneDNN copy,
and a bf16 model computing in fp32 whose one-call layer stack takes it."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.config import CacheConfig
from radixlm.runtime.models import cpu_linear
from radixlm.runtime.models.cpu_linear import PackedLinear, linear_bf16_fp32_max_rows

pytestmark = pytest.mark.skipif(
    linear_bf16_fp32_max_rows() == 0, reason="the fp32 path needs the built op and AVX2 + FMA"
)


def _op():
    return cpu_linear._op()


def _linear(x, w, b=None, gated=False):
    op = _op()
    n = w.shape[0] // 2 if gated else w.shape[0]
    return op.linear_bf16(x, op.pack_bf16_linear(w, gated), b, n, gated)


@pytest.mark.parametrize(
    "n,k", [(16, 64), (960, 576), (577, 100), (15, 33), (3, 1536), (40, 7), (50, 517)]
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8, 11, 12, 13, 16, 17, 40, 211])
def test_fp32_linear_matches_a_float64_product(n, k, bias, m):
    gen = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen) if bias else None
    out = _linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(960, 576), (577, 101), (3, 33), (40, 517)])
def test_fp32_rows_do_not_depend_on_the_batch(n, k):
    """Every output is one fp32 FMA chain over k in order in both kernels (few-row passes, 6-row
    blocks): a row's output is bit-identical alone and in any batch."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen)
    op = _op()
    wp = op.pack_bf16_linear(w)
    for m in [*range(2, 18), 33, 200]:
        x = torch.randn(m, k, generator=gen)
        alone = torch.cat([op.linear_bf16(x[i : i + 1], wp, b, n) for i in range(m)])
        assert torch.equal(op.linear_bf16(x, wp, b, n), alone), m


@pytest.mark.parametrize("inter,k", [(1536, 576), (40, 33), (7, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 100])
def test_fp32_gated_equals_silu_and_mul_after_the_projection(inter, k, bias, m):
    gen = torch.Generator().manual_seed(inter + k + m)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    b = torch.randn(2 * inter, generator=gen) if bias else None
    fused = _linear(x, w, b, gated=True)
    assert fused.shape == (m, inter) and fused.dtype == torch.float32
    assert torch.equal(fused, _op().silu_and_mul(_linear(x, w, b)))
    gu = F.linear(x.double(), w.double(), None if b is None else b.double())
    ref = F.silu(gu[:, :inter]) * gu[:, inter:]
    torch.testing.assert_close(fused.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_fp32_linear_of_no_rows_and_bad_inputs():
    op = _op()
    wp = op.pack_bf16_linear(torch.zeros(4, 8).bfloat16())
    assert op.linear_bf16(torch.zeros(0, 8), wp, None, 4).shape == (0, 4)
    with pytest.raises(RuntimeError, match="bf16 or fp32 x"):
        op.linear_bf16(torch.zeros(1, 8, dtype=torch.float64), wp, None, 4)
    with pytest.raises(RuntimeError, match="packed for 8"):
        op.linear_bf16(torch.zeros(2, 10), wp, None, 4)


@pytest.mark.parametrize("gated", [False, True])
def test_packed_linear_computing_in_fp32_takes_the_kernel(gated):
    """An fp32 linear of a bf16 model on a CPU computing in fp32 (`lowp` bf16): inputs of up to
    `linear_bf16_fp32_max_rows()` rows run the kernel on the bf16 copy: every row count on an
    AVX2 CPU, with no oneDNN copy kept; with AVX-512F the few-row passes, oneDNN's fp32 GEMM
    above. No other low-precision copy is kept."""
    most = linear_bf16_fp32_max_rows()
    if most < sys.maxsize and not cpu_linear.onednn_available():
        pytest.skip("torch built without oneDNN (the rows above the kernel's)")
    torch.manual_seed(0)
    lin = nn.Linear(96, 2 * 40 if gated else 80).to(torch.bfloat16).float()
    packed = PackedLinear(lin, lowp=torch.bfloat16, gated=gated)
    assert packed.weight_bf16 is not None and packed.weight_lowp is None
    assert packed.kernel_dtype == torch.float32 and packed.bf16_max_rows == most
    assert (packed.packed is None) == (most == sys.maxsize) and packed.gated == gated
    x = torch.randn(300, 96)
    n = 40 if gated else 80
    for rows in (1, 12, 13, 32, 33, 300):
        ref = lin(x[:rows])
        if gated:
            ref = F.silu(ref[:, :40]) * ref[:, 40:]
        out = packed(x[:rows])
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        if rows <= most:
            kernel = _op().linear_bf16(x[:rows], packed.weight_bf16, lin.bias, n, gated)
            assert torch.equal(out, kernel)


@pytest.mark.parametrize("n,k", [(16, 64), (577, 100), (50, 517)])
@pytest.mark.parametrize("m", [1, 3, 5, 8, 13, 40])
def test_fp32_logits_variant_is_the_product_with_the_masks(n, k, m):
    """`linear_bf16_logits` on fp32 x (the LM head computing in fp32) = `linear_bf16` then
    `apply_token_bitmask_torch` on `rows`, through both fp32 kernels (few rows, blocked)."""
    from radixlm.runtime.grammar.bitmask import apply_token_bitmask_torch

    gen = torch.Generator().manual_seed(n + 7 * k + m)
    x = torch.randn(m, k, generator=gen)
    wp = _op().pack_bf16_linear(torch.randn(n, k, generator=gen).bfloat16())
    b = torch.randn(n, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (m, (n + 31) // 32), generator=gen)
    bitmask = bitmask.to(torch.int32)
    bitmask[:, ::3] = 0
    chosen = list(range(0, m, 2))
    for bias in (None, b):
        got = _op().linear_bf16_logits(x, wp, bias, n, bitmask, torch.tensor(chosen).long())
        want = _op().linear_bf16(x, wp, bias, n)
        apply_token_bitmask_torch(want, bitmask, chosen)
        assert got.dtype == torch.float32 and torch.equal(got, want), (n, k, m)


def test_packed_head_computing_in_fp32_takes_masks():
    torch.manual_seed(0)
    lin = nn.Linear(96, 70, bias=False).to(torch.bfloat16).float()
    head = PackedLinear(lin, lowp=torch.bfloat16)
    x = torch.randn(8, 96)
    assert head.takes_masks(x) and not head.takes_masks(x.bfloat16())
    bitmask = torch.zeros(8, 3, dtype=torch.int32)
    bitmask[:, 2] = 0b101  # tokens 64 and 66
    out = head.masked_logits(x, bitmask, [1, 6])
    want = head(x)
    assert torch.equal(out[[0, 2, 3, 4, 5, 7]], want[[0, 2, 3, 4, 5, 7]])
    for r in (1, 6):
        assert torch.isfinite(out[r]).nonzero().flatten().tolist() == [64, 66]
    assert torch.equal(head.masked_logits(x), want)


def test_bf16_model_computing_in_fp32_runs_the_stack_on_the_kernel(make_tiny_model, runner_logits):
    """`matmul_dtype="float32"` on a bf16 model (what "auto" picks on a CPU without native
    bf16): the one-call layer stack applies, its linears take the packed kernel on fp32
    activations, and its logits match the eager fp32-compute reference."""
    from radixlm.runtime import model_runner as mr

    model_dir = make_tiny_model("llama", 7, hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)  # fmt: skip
    kw = dict(attention_backend="cpu", matmul_dtype="float32")
    cfg = CacheConfig(page_size=16, num_pages=8)
    compiled = mr.ModelRunner(model_dir, "bfloat16", torch.device("cpu"), cfg, **kw)
    assert compiled.compute_dtype == torch.float32
    stack = compiled.model.stack
    assert stack is not None and len(stack.packed) == 4 * 2
    assert "on fp32 activations" in compiled.linear_method
    eager = mr.ModelRunner(
        model_dir, "bfloat16", torch.device("cpu"), cfg, enforce_eager=True, **kw
    )
    a = runner_logits(compiled, (7, 20, 1, 1, 1), 4)
    b = runner_logits(eager, (7, 20, 1, 1, 1), 4)
    torch.testing.assert_close(a, b, atol=2e-2, rtol=1e-2)  # bf16 K/V, q rounded apart
