"""Greedy outputs of the engine equal transformers' `generate`, token for token (float32),
under every batching configuration, with all prompts submitted together."""

from __future__ import annotations

import pytest
from e2e_prompts import NEW_TOKENS

from radixlm import Engine, SamplingParams

CONFIGS = {
    "cache-chunk32": dict(enable_prefix_caching=True, chunked_prefill_size=32),
    "cache-chunk128": dict(enable_prefix_caching=True, chunked_prefill_size=128),
    "cache-nochunk": dict(enable_prefix_caching=True, chunked_prefill_size=None),
    "nocache-chunk128": dict(enable_prefix_caching=False, chunked_prefill_size=128),
    "nocache-nochunk": dict(enable_prefix_caching=False, chunked_prefill_size=None),
    # 48 pages x 16 = 768 token slots for ~3300 tokens of work: forces eviction and retraction.
    "cache-retract": dict(enable_prefix_caching=True, chunked_prefill_size=64, num_pages=48),
    # Speculative decoding (prompt-lookup drafts verified in the forward): the same tokens.
    "cache-spec-ngram": dict(
        enable_prefix_caching=True, chunked_prefill_size=128, speculative_algorithm="ngram"
    ),
    # A draft model: the default model with int4 weights drafting for itself.
    "cache-spec-draft": dict(
        enable_prefix_caching=True,
        chunked_prefill_size=128,
        speculative_algorithm="draft",
        speculative_draft_model="default",
        speculative_draft_quantization="int4",
    ),  # fmt: skip
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(name, default_model_dir, mixed_prompts, hf_reference):
    kwargs = dict(num_pages=512, max_batched_tokens=512, max_running_requests=16)
    kwargs.update(CONFIGS[name])
    with Engine(str(default_model_dir), dtype="float32", debug_integrity=True, **kwargs) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        results = engine.generate(mixed_prompts, params)
        mismatches = [
            (i, len(p), r.output_token_ids, ref)
            for i, (p, r, ref) in enumerate(zip(mixed_prompts, results, hf_reference))
            if r.output_token_ids != ref
        ]
        assert not mismatches, mismatches
        assert all(r.finish_reason == "length" for r in results)
        stats = engine.stats()
        if name == "cache-retract":
            assert stats.num_retractions > 0
        if "spec" in name:
            assert stats.spec_accepted_tokens > 0, stats
        if name.startswith("cache"):
            assert stats.cache_hit_tokens > 0
        else:
            assert stats.cache_hit_tokens == 0
        engine.check_integrity()
        assert stats.kv_pages_used == 0
        assert stats.kv_pages_free + stats.kv_pages_cached == stats.kv_pages_total
