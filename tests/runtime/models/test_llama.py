"""Our Llama-family model against transformers on tiny random-weight models (float32)."""

from __future__ import annotations

import json

import pytest
import torch
from family_check import hf_logits, run_chunks

from radixlm.config import CacheConfig
from radixlm.runtime.model_runner import ModelRunner


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("chunks", [[40], [1] * 6 + [34], [16, 16, 8], [7, 13, 20]])
def test_logits_match_transformers(request, fixture, chunks):
    model_dir = request.getfixturevalue(fixture)
    ids = [(i * 7919) % 40000 + 5 for i in range(40)]
    runner = ModelRunner(
        model_dir, "float32", torch.device("cpu"), CacheConfig(page_size=4, num_pages=16)
    )
    ours = run_chunks(runner, ids, chunks)
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=2e-4, rtol=1e-4)


def test_rope_scaling_llama3_matches_transformers(tiny_llama_dir, tmp_path):
    import shutil

    d = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    (d / "config.json").write_text(json.dumps(cfg))
    ids = [(i * 31) % 30000 + 7 for i in range(120)]
    runner = ModelRunner(d, "float32", torch.device("cpu"), CacheConfig(page_size=8, num_pages=20))
    ours = run_chunks(runner, ids, [64, 56])
    torch.testing.assert_close(ours, hf_logits(d, ids), atol=2e-4, rtol=1e-4)


def test_bf16_runs_and_is_close(tiny_llama_dir):
    ids = list(range(10, 42))
    r32 = ModelRunner(
        tiny_llama_dir, "float32", torch.device("cpu"), CacheConfig(page_size=4, num_pages=16)
    )
    r16 = ModelRunner(
        tiny_llama_dir, "bfloat16", torch.device("cpu"), CacheConfig(page_size=4, num_pages=16)
    )
    assert r16.kv_cache.k_buffers[0].dtype == torch.bfloat16
    a, b = run_chunks(r32, ids, [32]), run_chunks(r16, ids, [32])
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_missing_weight_is_an_error(tiny_llama_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, d)
    f = next(d.glob("*.safetensors"))
    tensors = load_file(f)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(KeyError, match="missing"):
        ModelRunner(d, "float32", torch.device("cpu"), CacheConfig(page_size=4, num_pages=16))


def test_llama_attention_bias_on_every_projection(tiny_llama_bias_dir):
    """Llama's `attention_bias=True` puts a bias on q/k/v *and* o_proj (Qwen2: q/k/v only)."""
    d = tiny_llama_bias_dir
    ids = [(i * 7919) % 40000 + 5 for i in range(24)]
    runner = ModelRunner(d, "float32", torch.device("cpu"), CacheConfig(page_size=4, num_pages=8))
    assert runner.model.layers[0].self_attn.o_proj.bias is not None
    ours = run_chunks(runner, ids, [10, 14])
    torch.testing.assert_close(ours, hf_logits(d, ids), atol=2e-4, rtol=1e-4)
