"""Tests for radixlm.runtime.models.model_info: config.json normalization across transformers
4.x / 5.x shapes (synthetic configs, no weights needed) and the served context length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixlm.runtime.models.model_info import (
    ModelInfo,
    context_length,
    load_model_info,
    normalize_rope_scaling,
)

# ---------------------------------------------------------------------------------------------
# config.json normalization (synthetic configs, no weights needed)
# ---------------------------------------------------------------------------------------------

_BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
}
_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _info_from(tmp_path: Path, generation: dict | None = None, **fields: object) -> ModelInfo:
    (tmp_path / "config.json").write_text(json.dumps({**_BASE_CONFIG, **fields}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return load_model_info(tmp_path)


def test_llama3_rope_scaling_4x_shape(tmp_path: Path) -> None:
    info = _info_from(tmp_path, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING)
    assert info.rope_theta == 500000.0
    assert info.rope_scaling == _LLAMA3_SCALING


def test_llama3_rope_scaling_5x_shape(tmp_path: Path) -> None:
    info = _info_from(tmp_path, rope_parameters={**_LLAMA3_SCALING, "rope_theta": 500000.0})
    assert info.rope_theta == 500000.0
    assert info.rope_scaling == _LLAMA3_SCALING


def test_legacy_type_key_and_default_rope(tmp_path: Path) -> None:
    info = _info_from(tmp_path, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert info.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 1.0}) is None
    assert normalize_rope_scaling(None) is None


def test_eos_ids_union_of_config_and_generation_config(tmp_path: Path) -> None:
    info = _info_from(
        tmp_path,
        generation={"eos_token_id": [128001, 128009], "bos_token_id": 1},
        eos_token_id=[128001, 128008],
    )
    assert info.eos_token_ids == (128001, 128008, 128009)
    assert info.bos_token_id == 1


def test_qwen2_implicit_bias_and_derived_head_dim(tmp_path: Path) -> None:
    qwen = {k: v for k, v in _BASE_CONFIG.items() if k != "architectures"}
    (tmp_path / "config.json").write_text(json.dumps({**qwen, "model_type": "qwen2"}))
    info = load_model_info(tmp_path)
    assert info.architecture == "Qwen2ForCausalLM"
    assert info.attention_bias and not info.attention_out_bias
    assert info.head_dim == 16


def test_llama_attention_bias_field_covers_o_proj(tmp_path: Path) -> None:
    info = _info_from(tmp_path, attention_bias=True, head_dim=32)
    assert info.attention_bias and info.attention_out_bias
    assert info.head_dim == 32


def test_sliding_window_models_serve_their_window(tmp_path):
    """Sliding-window attention is not implemented: the context is clamped to the window (where
    full attention is exact) and a longer max_model_len is refused with a clear error."""
    from transformers import AutoConfig

    kw = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    kw.update(intermediate_size=128, vocab_size=256, max_position_embeddings=512)
    AutoConfig.for_model("mistral", sliding_window=32, **kw).save_pretrained(tmp_path / "m")
    info = load_model_info(tmp_path / "m")
    assert info.sliding_window == 32
    assert context_length(info, None) == 32 and context_length(info, 16) == 16
    with pytest.raises(ValueError, match="sliding attention window"):
        context_length(info, 64)
    AutoConfig.for_model("mistral", sliding_window=None, **kw).save_pretrained(tmp_path / "f")
    full = load_model_info(tmp_path / "f")
    assert full.sliding_window is None and context_length(full, None) == 512
    AutoConfig.for_model(
        "qwen2", use_sliding_window=False, sliding_window=32, **kw
    ).save_pretrained(tmp_path / "q")
    assert load_model_info(tmp_path / "q").sliding_window is None
