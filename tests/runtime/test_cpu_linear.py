"""Matmul dtype policy on CPU (`radixlm.runtime.models.cpu_linear`)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from radixlm.runtime.models import cpu_linear
from radixlm.runtime.models.cpu_linear import SMALL_ROWS, add_lowp_copies, compute_dtype

CPU = torch.device("cpu")


def test_policy(monkeypatch):
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda: False)
    assert compute_dtype(torch.bfloat16, CPU, "auto") == torch.float32
    assert compute_dtype(torch.bfloat16, CPU, "model") == torch.bfloat16
    assert compute_dtype(torch.float32, CPU, "auto") == torch.float32
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda: True)
    assert compute_dtype(torch.bfloat16, CPU, "auto") == torch.bfloat16
    assert compute_dtype(torch.bfloat16, CPU, "float32") == torch.float32
    with pytest.raises(ValueError, match="matmul_dtype"):
        compute_dtype(torch.bfloat16, CPU, "int8")


def test_small_rows_use_the_lowp_copy_and_large_rows_fp32():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    ref = nn.Linear(32, 16)
    ref.load_state_dict(lin.state_dict())
    assert add_lowp_copies(nn.Sequential(lin), torch.bfloat16) == 1
    big = torch.randn(SMALL_ROWS + 3, 32)
    torch.testing.assert_close(lin(big), ref(big))  # fp32 path: exact
    small = big[:SMALL_ROWS]
    out = lin(small)
    assert out.dtype == torch.float32
    bf16 = nn.functional.linear(
        small.bfloat16(), ref.weight.bfloat16(), ref.bias.bfloat16()
    ).float()
    torch.testing.assert_close(out, bf16)  # the bf16 copy, as the model dtype would give
    torch.testing.assert_close(out, ref(small), atol=0.05, rtol=0.05)


def test_engine_on_a_cpu_without_bf16_keeps_a_bf16_kv_cache(monkeypatch, tiny_llama_dir):
    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner

    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda: False)
    r = ModelRunner(tiny_llama_dir, "bfloat16", CPU, CacheConfig(page_size=4, num_pages=8))
    assert r.compute_dtype == torch.float32
    assert r.kv_cache.k_buffers[0].dtype == torch.bfloat16
    down = r.model.layers[0].mlp.down_proj
    if cpu_linear.onednn_available():  # the compiled forward
        assert isinstance(down, cpu_linear.PackedLinear)
        most = cpu_linear.linear_bf16_fp32_max_rows()
        if most > 0:  # radixlm's kernel on a packed bf16 copy
            assert down.weight_bf16 is not None and down.weight_lowp is None
            # every row count (AVX2): no oneDNN copy; with AVX-512F oneDNN's fp32 above
            assert (down.packed is None) == (most == sys.maxsize)
        else:  # oneDNN's packed fp32 + a bf16 copy for few rows
            assert down.packed.dtype == torch.float32
            assert down.weight_lowp.dtype == torch.bfloat16
    else:
        assert isinstance(down, cpu_linear.SmallRowsLowpLinear)
    eager = ModelRunner(
        tiny_llama_dir, "bfloat16", CPU, CacheConfig(page_size=4, num_pages=8), enforce_eager=True
    )
    assert isinstance(eager.model.layers[0].mlp.down_proj, cpu_linear.SmallRowsLowpLinear)
    assert eager.layer_ops == "torch" and eager.linear_method == "dense"


needs_onednn = pytest.mark.skipif(
    not cpu_linear.onednn_available(), reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 300])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool, rows: int) -> None:
    if dtype == torch.bfloat16 and not cpu_linear.onednn_packs_bf16():
        pytest.skip("oneDNN packs no bf16 weights on this CPU (AVX2 only)")
    torch.manual_seed(rows)
    lin = nn.Linear(96, 80, bias=bias).to(dtype)
    packed = cpu_linear.PackedLinear(lin)
    x = torch.randn(rows, 96).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(packed(x), lin(x), **tol)


@needs_onednn
def test_pack_linears_leaves_bf16_weights_oneDNN_cannot_pack(monkeypatch) -> None:
    """On an AVX2-only CPU oneDNN refuses to reorder bf16 weights (a bf16 model with
    `matmul_dtype="model"` there): those linears stay plain and still compute."""
    monkeypatch.setattr(cpu_linear, "onednn_packs_bf16", lambda: False)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4).to(torch.bfloat16))
    assert cpu_linear.pack_linears(model) == 1
    assert isinstance(model[0], cpu_linear.PackedLinear) and type(model[1]) is nn.Linear
    assert model[1](model[0](torch.randn(3, 8)).bfloat16()).shape == (3, 4)


@needs_onednn
def test_pack_linears_replaces_plain_linears_only() -> None:
    class Row(nn.Linear):  # a tensor-parallel linear keeps its own forward
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), Row(4, 4))
    assert cpu_linear.pack_linears(model) == 2
    assert isinstance(model[0], cpu_linear.PackedLinear)
    assert isinstance(model[1][0], cpu_linear.PackedLinear)
    assert type(model[2]) is Row
    y = model(torch.randn(3, 8))
    assert y.shape == (3, 4)


@needs_onednn
def test_packed_linear_small_rows_use_the_lowp_copy(monkeypatch) -> None:
    """Where radixlm's fp32-activation kernel is not built: `F.linear` on a bf16 copy."""
    monkeypatch.setattr(cpu_linear, "linear_bf16_fp32_max_rows", lambda: 0)
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    packed = cpu_linear.PackedLinear(lin, lowp=torch.bfloat16)
    small = torch.randn(SMALL_ROWS, 32)
    bf16 = nn.functional.linear(small.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    torch.testing.assert_close(packed(small), bf16.float())
    big = torch.randn(SMALL_ROWS + 5, 32)
    torch.testing.assert_close(packed(big), lin(big), atol=1e-5, rtol=1e-5)
