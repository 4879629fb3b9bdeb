"""radixlm's int8 CPU kernel (`kernels/cpu/int8_gemm.cpp`): the product against an fp32 product on
the exact weights (every int8 value, N tails, K not a multiple of 64, 1..17 rows), each row's
result independent of the other rows, agreement with torch's `_weight_int8pack_mm`, refusals of
bad inputs, and the kernel the int8 linears and the LM head choose."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.grammar.bitmask import apply_token_bitmask_torch
from radixlm.runtime.quantization import QuantLinear, quantize_int8
from radixlm.runtime.quantization import kernels as qk
from radixlm.runtime.quantization.kernels import int8_rows_supported

pytestmark = pytest.mark.skipif(
    not int8_rows_supported(), reason="the int8 kernel needs the built op and AVX512_BF16"
)
CPU = torch.device("cpu")


def _op():
    return qk._g32_op()


def _ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # fp32 [T, N]
    return (x.float() @ q.float().t()) * s.float()


@pytest.mark.parametrize("n,k", [(16, 64), (1, 1), (17, 100), (37, 63), (960, 576), (45, 1536)])
def test_kernel_matches_fp32_product(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = (torch.rand(n, generator=gen) * 0.02 + 1e-3).bfloat16()
    for rows in range(1, 18):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        y = _op().int8_mm(x, q, s)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        ref = _ref(x, q, s)
        # fp32 sums in another order, one rounding to bf16
        tol = 2**-8 * ref.abs() + 1e-4 * ref.abs().max()
        assert ((y.float() - ref).abs() <= tol).all(), (n, k, rows)


def test_every_int8_value_is_exact() -> None:
    """Each of the 256 values alone in a row against a one-hot input: the nibble split is exact
    (16 * hi + lo, hi signed)."""
    q = torch.arange(-128, 128, dtype=torch.int8).reshape(256, 1).repeat(1, 70)
    s = torch.ones(256, dtype=torch.bfloat16)
    for j in (0, 1, 2, 3, 63, 64, 69):
        x = torch.zeros(1, 70, dtype=torch.bfloat16)
        x[0, j] = 1
        y = _op().int8_mm(x, q, s)
        assert torch.equal(y[0].float(), torch.arange(-128, 128).float()), j


def test_rows_do_not_depend_on_each_other() -> None:
    """A row's output is bit-identical whatever else shares the call (batch-invariant greedy)."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (300, 576), generator=gen, dtype=torch.int8)
    s = (torch.rand(300, generator=gen) * 0.01).bfloat16()
    x = torch.randn(13, 576, generator=gen).bfloat16()
    alone = _op().int8_mm(x[1:2], q, s)[0]
    for rows in (2, 3, 8, 9, 13):
        assert torch.equal(_op().int8_mm(x[:rows], q, s)[1], alone), rows


def test_matches_torchs_int8_kernel() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (128, 576), generator=gen, dtype=torch.int8)
    s = (torch.rand(128, generator=gen) * 0.01).bfloat16()
    x = torch.randn(8, 576, generator=gen).bfloat16()
    ours = _op().int8_mm(x, q, s).float()
    theirs = torch.ops.aten._weight_int8pack_mm(x, q, s).float()
    assert ((ours - theirs).abs() <= 2**-7 * theirs.abs() + 1e-3).all()


def test_empty_inputs_and_refusals() -> None:
    q = torch.zeros(16, 64, dtype=torch.int8)
    s = torch.ones(16, dtype=torch.bfloat16)
    assert _op().int8_mm(torch.zeros(0, 64, dtype=torch.bfloat16), q, s).shape == (0, 16)
    with pytest.raises(RuntimeError, match="columns"):
        _op().int8_mm(torch.zeros(1, 32, dtype=torch.bfloat16), q, s)
    with pytest.raises(RuntimeError, match="bf16"):
        _op().int8_mm(torch.zeros(1, 64), q, s)
    with pytest.raises(RuntimeError, match="scales"):
        _op().int8_mm(torch.zeros(1, 64, dtype=torch.bfloat16), q, s.float())
    with pytest.raises(RuntimeError, match="int8"):
        _op().int8_mm(torch.zeros(1, 64, dtype=torch.bfloat16), q.to(torch.uint8), s)


def test_bf16_int8_linears_choose_the_kernel_and_fp32_keeps_torchs() -> None:
    torch.manual_seed(0)
    qw = quantize_int8(torch.randn(48, 128))
    fast = QuantLinear(qw, None, torch.bfloat16, CPU)
    assert fast.kernel is qk.INT8_ROWS and fast.kernel.plain_rows
    assert QuantLinear(qw, None, torch.float32, CPU).kernel is qk.KERNELS[("cpu", 8)]
    for rows in (1, 8, 17, qk.INT8_ROWS_DEQUANT_MIN_ROWS):  # the last: the dequantized path
        x = torch.randn(rows, 128).bfloat16()
        ref = _ref(x, fast.qweight, fast.scales)
        assert ((fast(x).float() - ref).norm() / ref.norm()).item() < 5e-3, rows


def _random_bitmask(rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    words = (n + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=gen).to(torch.int32)
    mask[:, ::3] = 0  # words allowing nothing (most of a grammar's row) and everything
    mask[:, 1::5] = -1
    return mask


@pytest.mark.parametrize("n,k", [(16, 64), (1, 1), (17, 100), (37, 63), (960, 576), (100, 0)])
@pytest.mark.parametrize("masked", [[], [0], [1, 3, 4], "all"])
def test_logits_variant_is_the_float_product_with_the_masks(n, k, masked) -> None:
    """`int8_mm_logits` = `int8_mm(...).float()` then `apply_token_bitmask_torch` on `rows`:
    the same bf16 values widened, -inf where a masked row's bit is 0."""
    gen = torch.Generator().manual_seed(7 * n + k)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = (torch.rand(n, generator=gen) * 0.02 + 1e-3).bfloat16()
    for rows in (1, 2, 5, 8, 9, 17):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        chosen = list(range(rows)) if masked == "all" else [r for r in masked if r < rows]
        bitmask = _random_bitmask(rows + 1, n, gen)  # a larger bitmask: its first rows count
        ids = torch.tensor(chosen, dtype=torch.long)
        got = _op().int8_mm_logits(x, q, s, bitmask, ids)
        want = _op().int8_mm(x, q, s).float()
        apply_token_bitmask_torch(want, bitmask, chosen)
        assert got.dtype == torch.float32 and torch.equal(got, want), (n, k, rows)


def test_logits_variant_refuses_bad_masks() -> None:
    q = torch.zeros(64, 16, dtype=torch.int8)
    s = torch.ones(64, dtype=torch.bfloat16)
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    ok = torch.zeros(2, 2, dtype=torch.int32)
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="too narrow"):
        _op().int8_mm_logits(x, q, s, torch.zeros(2, 1, dtype=torch.int32), rows)
    with pytest.raises(RuntimeError, match="int32"):
        _op().int8_mm_logits(x, q, s, ok.long(), rows)
    with pytest.raises(RuntimeError, match="out of range"):
        _op().int8_mm_logits(x, q, s, ok, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="out of range"):
        _op().int8_mm_logits(x, q, s, ok[:1], rows)


def test_the_int8_head_takes_masks_for_few_rows_only() -> None:
    torch.manual_seed(0)
    qw = quantize_int8(torch.randn(70, 128))
    head = QuantLinear(qw, None, torch.bfloat16, CPU)
    few, many = torch.randn(8, 128).bfloat16(), torch.randn(qk.INT8_ROWS_DEQUANT_MIN_ROWS, 128)
    assert head.takes_masks(few) and not head.takes_masks(many.bfloat16())
    assert not QuantLinear(qw, None, torch.float32, CPU).takes_masks(few.float())
    bitmask = torch.zeros(8, 3, dtype=torch.int32)
    bitmask[:, 2] = 0b101  # tokens 64 and 66
    out = head.masked_logits(few, bitmask, [2, 5])
    want = head(few).float()
    assert torch.equal(out[[0, 1, 3, 4, 6, 7]], want[[0, 1, 3, 4, 6, 7]])
    for r in (2, 5):
        assert torch.isfinite(out[r]).nonzero().flatten().tolist() == [64, 66]
        assert torch.equal(out[r, [64, 66]], want[r, [64, 66]])
