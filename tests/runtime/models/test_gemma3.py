"""Gemma 3 text against transformers, float32: GeGLU, scaled embeddings, (1 + w) norms, q/k norm,
four norms per layer, local/global RoPE bases, and interleaved sliding-window layers on prompts
longer than the window (the full context is served, not clamped to the window)."""

from __future__ import annotations

import pytest
from family_check import (
    PROMPTS,
    assert_engine_matches_generate,
    assert_logits_match,
)

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tiny_gemma3_dir(make_tiny_model):
    return make_tiny_model(
        "gemma3_text",
        seed=10,
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def tiny_gemma3_softcap_dir(make_tiny_model):
    return make_tiny_model(
        "gemma3_text",
        seed=11,
        num_hidden_layers=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("chunks", [[30], [7, 13, 10], [3, 1, 1, 1, 24]])
def test_logits_match_transformers(tiny_gemma3_dir, backend, chunks):
    ids = [(i * 7919) % 40000 + 5 for i in range(30)]
    runner = assert_logits_match(tiny_gemma3_dir, ids, chunks, backend)
    assert runner.model.sliding_windows() == [WINDOW, 0, WINDOW]


def test_softcapping_matches_transformers(tiny_gemma3_softcap_dir):
    """Final logits capped; the attention cap is ignored, as transformers' Gemma 3 does."""
    ids = [(i * 31) % 30000 + 7 for i in range(20)]
    assert_logits_match(tiny_gemma3_softcap_dir, ids, [6, 14])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_greedy_matches_generate(tiny_gemma3_dir, backend):
    """Every prompt is longer than the window; chunked prefill and decode cross it."""
    assert all(len(p) > WINDOW for p in PROMPTS[:3])
    assert_engine_matches_generate(tiny_gemma3_dir, attention_backend=backend)


def test_full_context_is_served(tiny_gemma3_dir):
    from radixlm.runtime.models.model_info import context_length, load_model_info

    info = load_model_info(tiny_gemma3_dir)
    assert info.sliding_window == WINDOW
    assert context_length(info, None) == info.max_position_embeddings


def test_retraction_matches_generate(tiny_gemma3_dir):
    """Six concurrent prompts in a pool too small for all of them: requests are retracted and
    recomputed, crossing the window again; outputs still equal `generate`."""
    from family_check import hf_greedy

    from radixlm import Engine, SamplingParams

    prompts = [[(i * 131 + j * 17) % 30000 + 9 for j in range(20)] for i in range(6)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=30, num_threads=1,
        chunked_prefill_size=8, max_batched_tokens=24,
    ) as engine:  # fmt: skip
        ours = [r.outputs[0].output_token_ids for r in engine.generate(prompts, params)]
        assert engine.stats().num_retractions > 0
        engine.check_integrity()
    assert ours == hf_greedy(tiny_gemma3_dir, prompts, 12)


def test_speculative_decoding_matches_generate(tiny_gemma3_dir):
    """Drafts (the radix tree's continuation of a repeated prompt) verified as extends over the
    sliding layers: accepted, and the tokens are `generate`'s."""
    from family_check import hf_greedy

    from radixlm import Engine, SamplingParams

    prompt = PROMPTS[2]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=64, num_threads=1,
        speculative_algorithm="ngram",
    ) as engine:  # fmt: skip
        first = engine.generate(prompt, params).outputs[0].output_token_ids
        again = engine.generate(prompt, params).outputs[0].output_token_ids
        assert engine.stats().spec_accepted_tokens > 0
        engine.check_integrity()
    assert first == again == hf_greedy(tiny_gemma3_dir, [prompt], 12)[0]
