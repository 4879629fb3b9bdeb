"""Phi-3 (checkpoint-fused qkv_proj / gate_up_proj, LongRoPE) against transformers, float32."""

from __future__ import annotations

import pytest
from family_check import assert_engine_matches_generate, assert_logits_match

LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.05 * i for i in range(8)],  # head_dim 16: 8 frequencies
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def tiny_phi3_dir(make_tiny_model):
    return make_tiny_model("phi3", seed=6, tie_word_embeddings=False, pad_token_id=0)


@pytest.fixture(scope="module")
def tiny_phi3_longrope_dir(make_tiny_model):
    return make_tiny_model(
        "phi3",
        seed=7,
        pad_token_id=0,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters=LONGROPE,
    )


@pytest.mark.parametrize("chunks", [[30], [7, 13, 10]])
def test_logits_match_transformers(tiny_phi3_dir, chunks):
    ids = [(i * 7919) % 40000 + 5 for i in range(30)]
    runner = assert_logits_match(tiny_phi3_dir, ids, chunks)
    assert type(runner.model).__name__ == "Phi3ForCausalLM"


def test_longrope_within_the_original_context(tiny_phi3_longrope_dir):
    """Short factors below `original_max_position_embeddings` (64), as transformers."""
    ids = [(i * 31) % 30000 + 7 for i in range(60)]
    runner = assert_logits_match(tiny_phi3_longrope_dir, ids, [24, 36])
    rotary = runner.model.rotary
    assert not (rotary.cos[:64] == rotary.cos[64:128]).all()


def test_engine_greedy_matches_generate(tiny_phi3_dir):
    assert_engine_matches_generate(tiny_phi3_dir)
