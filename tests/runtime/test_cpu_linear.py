"""Matmul dtype policy on CPU (`radixlm.runtime.models.cpu_linear`)."""

from __future__ import annotations

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
    assert isinstance(r.model.layers[0].mlp.down_proj, cpu_linear.SmallRowsLowpLinear)
