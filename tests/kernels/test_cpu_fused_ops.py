"""The fused CPU layer ops (`radixlm.kernels.cpu.fused`, the `cpu` layer-op set) against their
torch twins in `radixlm.kernels.reference`: RMSNorm with and without the residual add, RoPE in
place on strided q/k views, SiLU-and-mul, and the K/V store; fp32 / bf16 / fp16, row counts
1..600 (one thread and the parallel path), hidden sizes that are and are not multiples of the
16-float vector; the float32 RMSNorm bit for bit against its sum in the op's stated order (the same
on AVX2 and AVX-512 builds). Bad input is a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.kernels.cpu import build
from radixlm.kernels.reference import rms_norm_ref, rope_ref, silu_and_mul_ref, store_kv

if build.load_op() is None:
    pytest.skip(f"CPU ops unavailable: {build.load_error()}", allow_module_level=True)

from radixlm.kernels.cpu import fused  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: bit-exact or 1-2 ulp (summation order, exp); bf16/fp16: one rounding step of the dtype
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 100), (37, 64), (600, 576)])
def test_rms_norm(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("hidden", [576, 72, 40, 13])
def test_rms_norm_sums_in_sixteen_lanes_bit_for_bit(hidden: int) -> None:
    """vec.h's `Sum16` order, emulated in numpy float32: lane l sums x[16 b + l]^2 over blocks b,
    then the 16 lanes in order. The op's result is these bits whatever its vector width (8 lanes
    on AVX2, 16 with AVX-512), so a model computes the same on both kinds of CPU."""
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(4, hidden, generator=g) * 3
    w = torch.rand(hidden, generator=g) + 0.5
    eps = np.float32(1e-5)
    want = np.empty((4, hidden), np.float32)
    for r, row in enumerate(x.numpy()):
        padded = np.zeros(-(-hidden // 16) * 16, np.float32)
        padded[:hidden] = row
        lanes = np.zeros(16, np.float32)
        for b in range(len(padded) // 16):
            block = padded[16 * b : 16 * b + 16]
            lanes = lanes + block * block  # float32, elementwise: one rounding each
        ss = np.float32(0)
        for v in lanes:
            ss = np.float32(ss + v)
        inv = np.float32(1) / np.sqrt(np.float32(ss / np.float32(hidden) + eps))
        want[r] = w.numpy() * (row * inv)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), torch.from_numpy(want), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 70), (300, 256)])
def test_add_rms_norm_updates_the_residual(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(7 + rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    res_ref = res.clone()
    y = fused.rms_norm(x, w, 1e-6, res)
    y_ref = rms_norm_ref(x, w, 1e-6, res_ref)
    torch.testing.assert_close(res, res_ref, atol=0, rtol=0)  # one rounded add: exact
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 9, 130])
def test_rope_in_place_on_qkv_views(dtype: torch.dtype, tokens: int) -> None:
    hq, hkv, d, positions = 9, 3, 64, 4096
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)  # strided views, as in the model
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(positions).float(), inv).repeat(1, 2)
    cos, sin = emb.cos(), emb.sin()
    pos = torch.randint(0, positions, (tokens,), generator=g)
    q_ref, k_ref = rope_ref(pos, q.clone(), k.clone(), cos, sin)
    before = qkv.clone()
    q2, k2 = fused.rope(pos, q, k, cos, sin)
    assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()  # in place
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(q2, q_ref, **tol)
    torch.testing.assert_close(k2, k_ref, **tol)
    torch.testing.assert_close(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])  # v kept


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 40), (257, 1536)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter + rows)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturating exp, both signs
    torch.testing.assert_close(fused.silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_store_kv(cache_dtype: torch.dtype, src_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    k_buf = torch.randn(64, 3, 16, generator=g).to(cache_dtype)
    v_buf = torch.randn(64, 3, 16, generator=g).to(cache_dtype)
    kv = torch.randn(5, 2, 3, 16, generator=g).to(src_dtype)
    k, v = kv[:, 0], kv[:, 1]  # strided rows
    slots = torch.tensor([0, 17, 63, 5, 6])
    kb, vb = k_buf.clone(), v_buf.clone()
    store_kv(kb, vb, slots, k, v)
    fused.store_kv(k_buf, v_buf, slots, k, v)
    assert torch.equal(k_buf, kb) and torch.equal(v_buf, vb)


def test_bad_input_is_a_clear_error() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        fused.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(RuntimeError, match="dtype must be float32"):
        fused.silu_and_mul(torch.randint(0, 3, (2, 8)))
    cos = torch.zeros(4, 8)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside the table"):
        fused.rope(torch.tensor([4]), q, k, cos, cos)
    buf = torch.zeros(4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.store_kv(buf, buf.clone(), torch.tensor([4]), k, k)
