"""radixlm's packed bf16 linear (`kernels/cpu/linear_bf16.cpp`): against an fp32 product (row
counts across the 8-row passes, input / output / K tails, bias), its batch invariance, the packed
layout, inside `PackedLinear` against the oneDNN path, the packing policy (`pack_linears`), and a
model runner's logits with and without it (the one-call layer stack passes the packed weights
per layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.config import CacheConfig
from radixlm.runtime.models import cpu_linear
from radixlm.runtime.models.cpu_linear import PackedLinear, bf16_kernel_supported, pack_linears

pytestmark = pytest.mark.skipif(
    not bf16_kernel_supported(), reason="the bf16 kernel needs the built op and AVX512_BF16"
)


def _op():
    return cpu_linear._op()


def _linear(x, w, b=None):
    op = _op()
    return op.linear_bf16(x, op.pack_bf16_linear(w), b, w.shape[0])


@pytest.mark.parametrize("n,k", [(16, 64), (960, 576), (577, 100), (15, 33), (3, 1536), (40, 7)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 11, 17, 64, 130])
def test_linear_matches_fp32_product(n, k, bias, m):
    gen = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = _linear(x, w, b)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    # fp32 accumulation, one rounding to bf16
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


def test_linear_of_a_strided_input():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 80, generator=gen).bfloat16()[:, :64]  # rows 80 apart
    w = torch.randn(24, 64, generator=gen).bfloat16()
    assert torch.equal(_linear(x, w), _linear(x.contiguous(), w))


def test_packed_layout():
    """Tile t, K pair p, lane 2j + i holds w[32 t + j, 2 p + i]; padding is zero."""
    w = torch.arange(40 * 7, dtype=torch.float32).view(40, 7).bfloat16()
    p = _op().pack_bf16_linear(w)
    assert p.shape == (2, 4, 64)
    for t, pair, j, i in [(0, 0, 0, 0), (0, 2, 5, 1), (1, 3, 7, 0), (1, 1, 3, 1)]:
        assert p[t, pair, 2 * j + i] == w[32 * t + j, 2 * pair + i]
    assert (p[1, :, 16:] == 0).all()  # outputs 40..63
    assert (p[:, 3, 1::2] == 0).all()  # column 7


@pytest.mark.parametrize("n,k", [(960, 576), (577, 100), (3, 33)])
def test_rows_do_not_depend_on_the_batch(n, k):
    """Each row's output is bit-identical whatever the other rows are: every output is one fp32
    sum over K pairs in order whatever the pass (batch invariance: a request's greedy tokens do
    not depend on how many others share its step)."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    op = _op()
    wp = op.pack_bf16_linear(w)
    for m in [*range(2, 18), 33, 70]:
        x = torch.randn(m, k, generator=gen).bfloat16()
        alone = torch.cat([op.linear_bf16(x[i : i + 1], wp, b, n) for i in range(m)])
        assert torch.equal(op.linear_bf16(x, wp, b, n), alone), m


def test_linear_of_no_rows_is_empty():
    """A step with no rows to project (a prefill chunk that wants no logits) gets [0, N]."""
    op = _op()
    out = op.linear_bf16(
        torch.zeros(0, 8).bfloat16(), op.pack_bf16_linear(torch.zeros(4, 8).bfloat16()),
        torch.zeros(4).bfloat16(), 4,
    )  # fmt: skip
    assert out.shape == (0, 4)
    lin = PackedLinear(nn.Linear(8, 4).to(torch.bfloat16), bf16_kernel=True)
    assert lin(torch.zeros(0, 8).bfloat16()).shape == (0, 4)


def test_linear_refuses_bad_shapes():
    op = _op()
    wp = op.pack_bf16_linear(torch.zeros(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        op.linear_bf16(torch.zeros(2, 3, 8).bfloat16(), wp, None, 4)
    with pytest.raises(RuntimeError, match="packed for 8"):
        op.linear_bf16(torch.zeros(2, 10).bfloat16(), wp, None, 4)
    with pytest.raises(RuntimeError, match="tiles"):
        op.linear_bf16(torch.zeros(2, 8).bfloat16(), wp, None, 40)
    with pytest.raises(RuntimeError, match="packed by pack_bf16_linear"):
        op.linear_bf16(torch.zeros(2, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), None, 4)
    with pytest.raises(RuntimeError, match="bf16 or fp32 x"):  # fp32 x is the AVX2 path's
        op.linear_bf16(torch.zeros(1, 8).half(), wp, None, 4)
    with pytest.raises(RuntimeError, match=r"b must be \[n\]"):
        op.linear_bf16(torch.zeros(1, 8).bfloat16(), wp, torch.zeros(5), 4)


def test_packed_linear_matches_onednn():
    torch.manual_seed(0)
    lin = nn.Linear(576, 960, bias=True).to(torch.bfloat16)
    fast, slow = PackedLinear(lin, bf16_kernel=True), PackedLinear(lin)
    assert fast.weight_bf16 is not None and slow.weight_bf16 is None and slow.packed is not None
    most = cpu_linear.linear_bf16_max_rows()
    assert most >= 8
    x = torch.randn(300, 576).bfloat16()
    for rows in (1, 3, 8, 9, 300):
        a, b = fast(x[:rows]), slow(x[:rows])
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2)
    if most < 300:  # AMX: oneDNN past the crossover, both copies kept
        assert fast.packed is not None and torch.equal(fast(x), slow(x))
    else:  # the packed copy is the only one
        assert fast.packed is None


def test_pack_linears_policy(monkeypatch):
    def model() -> nn.Module:
        m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64, bias=False))
        return m.to(torch.bfloat16)

    m = model()
    assert pack_linears(m, bf16_kernel=True) == 2
    assert all(lin.weight_bf16 is not None for lin in m)
    m = model()
    pack_linears(m)
    assert all(lin.weight_bf16 is None and lin.packed is not None for lin in m)
    # where the kernel takes only a few rows (AMX), both copies only for small models
    monkeypatch.setattr(cpu_linear, "linear_bf16_max_rows", lambda: 8)
    monkeypatch.setattr(cpu_linear, "DUAL_MAX_WEIGHT_BYTES", 100)
    m = model()
    pack_linears(m, bf16_kernel=True)
    assert all(lin.weight_bf16 is None and lin.packed is not None for lin in m)
    monkeypatch.setattr(cpu_linear, "DUAL_MAX_WEIGHT_BYTES", 1 << 30)
    m = model()
    pack_linears(m, bf16_kernel=True)
    assert all(lin.weight_bf16 is not None and lin.packed is not None for lin in m)


def test_runner_logits_with_the_bf16_kernel(make_tiny_model, monkeypatch, runner_logits):
    """A bf16 runner's layer stack takes the packed kernel for every forward; the logits of
    prefill, extend and decodes match a runner on oneDNN."""
    from radixlm.runtime import model_runner as mr

    model_dir = make_tiny_model("llama", 7, hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)  # fmt: skip
    logits = {}
    for on in (True, False):
        if not on:
            monkeypatch.setattr(cpu_linear, "bf16_kernel_supported", lambda: False)
        runner = mr.ModelRunner(
            model_dir, "bfloat16", torch.device("cpu"), CacheConfig(page_size=16, num_pages=8),
            attention_backend="cpu",
        )  # fmt: skip
        stack = runner.model.stack
        assert stack is not None and len(stack.packed) == (4 * 2 if on else 0)
        logits[on] = runner_logits(runner, (7, 20, 1, 1, 1), 4)
    torch.testing.assert_close(logits[True], logits[False], atol=5e-2, rtol=5e-2)


def test_bf16_engine_with_chunked_prefill_takes_the_bf16_kernel(make_tiny_model):
    """A bf16 engine whose prompts span several prefill chunks: the chunks that want no logits
    send 0 rows to the LM head (the kernel returns [0, N]), the decode steps 1-3 rows; every
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
            getattr(m, "weight_bf16", None) is not None for m in engine.runner.model.modules()
        )
        prompts = [[(i * 7919 + j) % 900 + 5 for i in range(40 + 9 * j)] for j in range(3)]
        params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
        outs = engine.generate(prompts, params)
    assert [len(o.outputs[0].output_token_ids) for o in outs] == [5, 5, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("inter,k", [(1536, 576), (40, 33), (7, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 40])
def test_gated_equals_silu_and_mul_after_the_projection(inter, k, bias, m):
    """Gated packing fuses SiLU-and-mul into the epilogue with the numerics of the two ops in
    sequence: bit-identical to `silu_and_mul(linear(x))`."""
    gen = torch.Generator().manual_seed(inter + k + m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16() if bias else None
    op = _op()
    fused = op.linear_bf16(x, op.pack_bf16_linear(w, True), b, inter, True)
    assert fused.shape == (m, inter)
    assert torch.equal(fused, op.silu_and_mul(_linear(x, w, b)))
    ref = F.silu(F.linear(x.float(), w[:inter].float(), None if b is None else b[:inter].float()))
    ref = ref * F.linear(x.float(), w[inter:].float(), None if b is None else b[inter:].float())
    torch.testing.assert_close(fused.float(), ref, atol=5e-2 * ref.abs().max().item(), rtol=3e-2)


def test_gated_packed_linear_in_an_mlp():
    """`pack_linears` packs a SiLU MLP's gate_up gated; the MLP's output is unchanged."""
    from radixlm.kernels.layer_ops import get_layer_ops
    from radixlm.runtime.models.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(64, 48, bias=False).to(torch.bfloat16)
    mlp.ops = get_layer_ops("cpu")
    x = torch.randn(5, 64).bfloat16()
    with torch.no_grad():
        before = mlp.down_proj(mlp.ops.silu_and_mul(mlp.gate_up_proj(x)))
        pack_linears(mlp, bf16_kernel=True)
        assert mlp.gate_up_proj.gated and not mlp.down_proj.gated
        torch.testing.assert_close(mlp(x).float(), before.float(), atol=3e-2, rtol=3e-2)
    geglu = MLP(64, 48, bias=False, act="gelu_pytorch_tanh").to(torch.bfloat16)
    pack_linears(geglu, bf16_kernel=True)
    assert not geglu.gate_up_proj.gated


def test_packed_weights_share_one_huge_page_arena():
    """`move_weights_to_huge_pages` moves the packed weights into one allocation (huge-page
    advised), in module order, with their values unchanged."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(640, 960), nn.Linear(960, 640)).to(torch.bfloat16)  # 2.3 MB
    x = torch.randn(3, 640).bfloat16()
    ref = m[1](m[0](x))
    pack_linears(m, bf16_kernel=True)
    assert cpu_linear.move_weights_to_huge_pages(m) == sum(lin.weight_bf16.numel() * 2 for lin in m)
    a, b = m[0].weight_bf16, m[1].weight_bf16
    assert a.data_ptr() % (2 << 20) == 0
    assert b.data_ptr() == a.data_ptr() + a.numel() * 2
    torch.testing.assert_close(m[1](m[0](x)).float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_resident_bytes_count_each_packed_weight_of_the_arena():
    """The packed weights are views of one arena: each counts once, by its own bytes."""
    from radixlm.runtime.models.weight_bytes import resident_weight_bytes

    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).to(torch.bfloat16)
    pack_linears(m, bf16_kernel=True)
    cpu_linear.move_weights_to_huge_pages(m)
    packed = sum(lin.weight_bf16.numel() * 2 for lin in m)
    biases = sum(lin.bias.numel() * 2 for lin in m)
    assert resident_weight_bytes(m) == packed + biases


def test_gated_linear_past_the_kernels_rows_takes_onednn_then_silu_and_mul(monkeypatch):
    """Where the kernel takes only a few rows (AMX CPUs), a gated linear's larger inputs run
    oneDNN's copy and the fused SiLU-and-mul op: the same [T, I] result."""
    monkeypatch.setattr(cpu_linear, "linear_bf16_max_rows", lambda: 8)
    torch.manual_seed(0)
    lin = nn.Linear(64, 2 * 48, bias=True).to(torch.bfloat16)
    gated = PackedLinear(lin, bf16_kernel=True, gated=True)
    assert gated.gated and gated.packed is not None and gated.bf16_max_rows == 8
    x = torch.randn(12, 64).bfloat16()
    with torch.no_grad():
        ref = _op().silu_and_mul(
            F.linear(x.float(), lin.weight.float(), lin.bias.float()).bfloat16()
        )
        small, large = gated(x[:8]), gated(x)
    assert small.shape == (8, 48) and large.shape == (12, 48)
    torch.testing.assert_close(large.float(), ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(small.float(), large[:8].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("n,k", [(16, 64), (577, 100), (40, 7), (1000, 64)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("masked", [[], [0], [1, 2, 8], "all"])
def test_logits_variant_is_the_float_product_with_the_masks(n, k, m, masked):
    """`linear_bf16_logits` = `linear_bf16(...).float()` then `apply_token_bitmask_torch` on
    `rows` (the LM head writing a grammar's masks into the logits), bias included."""
    from radixlm.runtime.grammar.bitmask import apply_token_bitmask_torch

    gen = torch.Generator().manual_seed(n * 31 + k + m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    wp = _op().pack_bf16_linear(w)
    chosen = list(range(m)) if masked == "all" else [r for r in masked if r < m]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (m + 2, (n + 31) // 32 + 1), generator=gen)
    bitmask = bitmask.to(torch.int32)
    bitmask[:, ::3] = 0
    bitmask[:, 1::4] = -1
    for bias in (None, b):
        got = _op().linear_bf16_logits(x, wp, bias, n, bitmask, torch.tensor(chosen).long())
        want = _op().linear_bf16(x, wp, bias, n).float()
        apply_token_bitmask_torch(want, bitmask, chosen)
        assert got.dtype == torch.float32 and torch.equal(got, want), (n, k, m)


def test_logits_variant_refuses_bad_masks():
    w = _op().pack_bf16_linear(torch.randn(64, 16).bfloat16())
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    ok = torch.zeros(2, 2, dtype=torch.int32)
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="too narrow"):
        _op().linear_bf16_logits(x, w, None, 64, torch.zeros(2, 1, dtype=torch.int32), rows)
    with pytest.raises(RuntimeError, match="out of range"):
        _op().linear_bf16_logits(x, w, None, 64, ok, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="bf16 or fp32 x"):
        _op().linear_bf16_logits(x.half(), w, None, 64, ok, rows)


def test_packed_head_takes_masks_for_the_kernels_rows():
    torch.manual_seed(0)
    head = PackedLinear(nn.Linear(64, 70, bias=False).bfloat16(), bf16_kernel=True)
    x = torch.randn(8, 64).bfloat16()
    assert head.takes_masks(x) and not head.takes_masks(x.float())
    gated = PackedLinear(nn.Linear(64, 140, bias=False).bfloat16(), bf16_kernel=True, gated=True)
    assert not gated.takes_masks(x)
    bitmask = torch.zeros(8, 3, dtype=torch.int32)
    bitmask[:, 2] = 0b101  # tokens 64 and 66
    out = head.masked_logits(x, bitmask, [2, 5])
    want = head(x).float()
    assert torch.equal(out[[0, 1, 3, 4, 6, 7]], want[[0, 1, 3, 4, 6, 7]])
    for r in (2, 5):
        assert torch.isfinite(out[r]).nonzero().flatten().tolist() == [64, 66]
        assert torch.equal(out[r, [64, 66]], want[r, [64, 66]])
