"""radixlm's int4 g32 CPU kernel (`kernels/cpu/int4_gemm.cpp`): the product against an fp32
product on the exact weights (odd N with tails, K not a multiple of 256, groups of 32 / 64 / 128,
1..17 rows), its layout against the Python twin, GGUF blocks without a float detour, refusals of
bad shapes, and the kernel the quantized linears choose."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.runtime.quantization import QuantizedWeight, QuantLinear, quantize_int4
from radixlm.runtime.quantization import kernels as qk
from radixlm.runtime.quantization.kernels import (
    dequantize_int4_g32,
    int4_g32_supported,
    pack_int4_g32,
)

pytestmark = pytest.mark.skipif(
    not int4_g32_supported(), reason="the int4 g32 kernel needs the built op and AVX512_BF16"
)
CPU = torch.device("cpu")


def _op():
    return qk._g32_op()


def _exact(qw: QuantizedWeight) -> torch.Tensor:  # [N, K] fp32: the weights the kernel uses
    g = qw.group_size
    s = qw.scales.half().float().repeat_interleave(g, dim=1)
    m = qw.mins.half().float().repeat_interleave(g, dim=1)  # type: ignore[union-attr]
    return qw.q.float() * s + m


@pytest.mark.parametrize(
    "n,k,group",
    [
        (16, 32, 32),
        (1, 64, 32),
        (17, 96, 32),
        (37, 288, 32),
        (960, 576, 32),
        (45, 384, 64),
        (33, 640, 128),
        (576, 1536, 32),
    ],
)
def test_kernel_matches_fp32_product(n: int, k: int, group: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    qw = quantize_int4(torch.randn(n, k, generator=gen), group)
    w, sm = pack_int4_g32(qw)
    assert w.shape == (n, k // 2) and sm.shape == (n, k // 32, 2) and sm.dtype == torch.float16
    exact = _exact(qw)
    assert torch.equal(dequantize_int4_g32(w, sm), exact)  # the twin reads the layout back
    for rows in range(1, 18):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        y = _op().int4_g32_mm(x, w, sm)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        ref = x.float() @ exact.t()
        # fp32 accumulation, one rounding to bf16 (half an ulp: 2^-9 relative) per output
        err = (y.float() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().max())
        assert err.max().item() < 8e-3, (rows, err.max().item())


def test_kernel_takes_non_contiguous_inputs_and_zero_rows() -> None:
    qw = quantize_int4(torch.randn(40, 64), 32)
    w, sm = pack_int4_g32(qw)
    x = torch.randn(64, 6).bfloat16().t()  # [6, 64], transposed
    assert torch.equal(_op().int4_g32_mm(x, w, sm), _op().int4_g32_mm(x.contiguous(), w, sm))
    assert _op().int4_g32_mm(x[:0], w, sm).shape == (0, 40)


def test_kernel_refuses_bad_shapes() -> None:
    w, sm = pack_int4_g32(quantize_int4(torch.randn(16, 64), 32))
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        _op().int4_g32_mm(x[:, :32], w, sm)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        _op().int4_g32_mm(x.float(), w, sm)
    with pytest.raises(RuntimeError, match="scales_mins must be contiguous float16"):
        _op().int4_g32_mm(x, w, sm.float())
    with pytest.raises(RuntimeError, match="do not match w"):
        _op().int4_g32_mm(x, w[:, :24].contiguous(), sm)  # K = 48: not groups of 32
    with pytest.raises(RuntimeError, match="w must be contiguous uint8"):
        _op().int4_g32_mm(x, w.view(torch.int8), sm)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4_g32(quantize_int4(torch.randn(4, 48), 16))
    big = quantize_int4(torch.randn(4, 64) * 1e6, 32)
    with pytest.raises(ValueError, match="float16's range"):
        pack_int4_g32(big)


def test_gguf_blocks_pack_without_a_float_copy() -> None:
    """Q4_0 / Q4_1 blocks (fp16 scales and mins) pack exactly: the kernel's weights are gguf's own
    dequantization, bit for bit. Q4_K's scales (fp16 `d` times a 6-bit integer) round once to
    fp16: within 2^-11 of each scale."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from radixlm.runtime.quantization.gguf_reader import decode_blocks

    rng = np.random.default_rng(1)
    rows, k = 24, 512
    for name in ("Q4_0", "Q4_1", "Q4_K"):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
        halves = 1 if name == "Q4_0" else 2
        sc = rng.uniform(-0.05, 0.05, size=(rows, k // block, halves)).astype(np.float16)
        raw[..., : 2 * halves] = sc.view(np.uint8).reshape(rows, k // block, 2 * halves)
        raw = raw.reshape(rows, -1)
        qw = decode_blocks(name, raw, rows, k)
        ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).reshape(rows, k))
        w, sm = pack_int4_g32(qw)
        got = dequantize_int4_g32(w, sm)
        if name == "Q4_K":
            assert (got - ref).abs().max() <= 2**-11 * 2 * ref.abs().max(), name
        else:
            assert torch.equal(got, ref), name


def test_bf16_linears_choose_the_kernel_and_fp32_keeps_torchs() -> None:
    torch.manual_seed(0)
    qw = quantize_int4(torch.randn(48, 128), 64)
    fast = QuantLinear(qw, None, torch.bfloat16, CPU)
    assert fast.kernel is qk.INT4_G32 and fast.scales.dtype == torch.float16
    assert QuantLinear(qw, None, torch.float32, CPU).kernel is qk.KERNELS[("cpu", 4)]
    assert fast.kernel.mm_dequantized is None  # every row count takes the kernel
    for rows in (1, 16, 17, 40):
        x = torch.randn(rows, 128).bfloat16()
        ref = x.float() @ _exact(qw).t()
        assert ((fast(x).float() - ref).norm() / ref.norm()).item() < 5e-3, rows
