"""Qwen3 (per-head q/k RMSNorm, head_dim from the config) against transformers, float32."""

from __future__ import annotations

import pytest
from family_check import assert_engine_matches_generate, assert_logits_match


@pytest.fixture(scope="module")
def tiny_qwen3_dir(make_tiny_model):
    # head_dim 32 != hidden / heads (16): the config's head_dim is the one used
    return make_tiny_model("qwen3", seed=5, head_dim=32, tie_word_embeddings=False)


@pytest.mark.parametrize("chunks", [[30], [7, 13, 10], [1] * 4 + [26]])
def test_logits_match_transformers(tiny_qwen3_dir, chunks):
    ids = [(i * 7919) % 40000 + 5 for i in range(30)]
    runner = assert_logits_match(tiny_qwen3_dir, ids, chunks)
    assert runner.model.head_dim == 32
    assert type(runner.model).__name__ == "Qwen3ForCausalLM"


def test_engine_greedy_matches_generate(tiny_qwen3_dir):
    assert_engine_matches_generate(tiny_qwen3_dir)
