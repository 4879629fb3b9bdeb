"""Triton RMSNorm (+ residual) and RoPE against their torch twins, and the twins against the
model's own modules (`RMSNorm`, `RotaryEmbedding`)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from radixlm.kernels.fused_ops import apply_rope, rms_norm
from radixlm.kernels.reference import rms_norm_ref, rope_ref
from radixlm.runtime.models.llama import RMSNorm, RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# NOTE: Triton's interpreter truncates fp32 -> bf16 (GPUs round to nearest even), so a bf16
# result may be 1-2 ulps (2^-7 relative each) off torch's.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize(
    "tokens,hidden,dtype,residual",
    [
        (5, 64, torch.float32, False),
        (3, 80, torch.float16, True),  # hidden not a power of two
        (4, 64, torch.bfloat16, True),
        (1, 96, torch.bfloat16, False),
    ],
)
def test_rms_norm_matches_twin(tokens, hidden, dtype, residual):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    res = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE) if residual else None
    res_ref = res.clone() if residual else None
    expected = rms_norm_ref(x, w, 1e-5, res_ref)
    out = rms_norm(x, w, 1e-5, res)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype])
    if residual:  # x + residual, rounded once (exactly torch's add, up to the bf16 NOTE above)
        tol = TOL[dtype] if dtype == torch.bfloat16 and DEVICE == "cpu" else 0.0
        torch.testing.assert_close(res, res_ref, atol=tol, rtol=tol)


def test_rms_norm_twin_is_the_model_norm():
    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(6, 48)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight.detach(), 1e-6), norm(x).detach())


def rope_tables(d: int, positions: int) -> RotaryEmbedding:
    cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, rope_theta=10000.0)
    return RotaryEmbedding(cfg, d, positions)


@pytest.mark.parametrize(
    "hq,hkv,d,dtype",
    [(4, 2, 16, torch.float32), (6, 2, 32, torch.float16), (8, 1, 64, torch.bfloat16)],
)
def test_rope_matches_twin_and_model(hq, hkv, d, dtype):
    rope = rope_tables(d, 64)
    gen = torch.Generator().manual_seed(d)
    t = 5
    pos = torch.tensor([0, 3, 17, 63, 8], device=DEVICE)
    # q/k as the model makes them: views into a fused qkv row.
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    cos, sin = rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    q_ref, k_ref = rope_ref(pos, q, k, cos, sin)
    q_out, k_out = apply_rope(pos, q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    q_mod, k_mod = rope.to(DEVICE)(pos, q, k)
    torch.testing.assert_close(q_ref, q_mod, atol=0, rtol=0)
    torch.testing.assert_close(k_ref, k_mod, atol=0, rtol=0)


def test_fused_ops_launcher_checks():
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(2, 32, device=DEVICE)[:, ::2], torch.ones(16, device=DEVICE), 1e-5)
    cos = torch.ones(4, 16, device=DEVICE)
    q = torch.randn(2, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="head dim"):
        apply_rope(torch.zeros(2, dtype=torch.long, device=DEVICE), q, q, cos[:, :8], cos[:, :8])
    with pytest.raises(ValueError, match="positions"):
        apply_rope(torch.zeros(3, dtype=torch.long, device=DEVICE), q, q, cos, cos)
