"""Prefix reuse on the real model: a shared 500-token prefix and multi-turn chat."""

from __future__ import annotations

import pytest
from e2e_prompts import make_prompt_ids

from radixlm import Engine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def engine(default_model_dir):
    with Engine(str(default_model_dir), dtype="float32", num_pages=256, debug_integrity=True) as e:
        yield e


@pytest.mark.slow
def test_second_request_computes_only_the_suffix(engine, tokenizer):
    prefix = make_prompt_ids(tokenizer, 500, seed=1)
    a = prefix + tokenizer.encode(" Summarize the text above.", add_special_tokens=False)
    b = prefix + tokenizer.encode(" What is the first word?", add_special_tokens=False)
    before = engine.stats().computed_prompt_tokens
    ra = engine.generate(a, GREEDY)
    mid = engine.stats().computed_prompt_tokens
    rb = engine.generate(b, GREEDY)
    after = engine.stats().computed_prompt_tokens
    assert mid - before == len(a)
    ps = engine.stats().page_size
    assert rb.usage.cached_tokens == (500 // ps) * ps
    assert after - mid == len(b) - rb.usage.cached_tokens  # only the suffix ran
    assert ra.usage.cached_tokens == 0
    # Same answer as without the cache (cached K/V are the same numbers).
    with Engine(
        str(engine.model_dir), dtype="float32", num_pages=128, enable_prefix_caching=False
    ) as cold:
        assert cold.generate(b, GREEDY).output_token_ids == rb.output_token_ids
    engine.check_integrity()


@pytest.mark.slow
def test_multi_turn_chat_reuses_previous_turn_output(engine):
    messages = [
        {"role": "system", "content": "You are a concise assistant. " * 20},
        {"role": "user", "content": "Name three colors."},
    ]
    turn1 = engine.generate(
        engine.apply_chat_template(messages), SamplingParams(max_new_tokens=24, temperature=0)
    )
    prompt1 = engine.tokenize(engine.apply_chat_template(messages))
    messages += [
        {"role": "assistant", "content": turn1.text},
        {"role": "user", "content": "Now name three animals."},
    ]
    prompt2 = engine.tokenize(engine.apply_chat_template(messages))
    turn2 = engine.generate(prompt2, SamplingParams(max_new_tokens=8, temperature=0))
    ps = engine.stats().page_size
    # The second turn's prompt starts with turn 1's prompt and output: all of it is cached up to
    # the last full page that turn 1 computed (its final sampled token has no K/V yet).
    common = 0
    full1 = prompt1 + turn1.output_token_ids
    while common < min(len(full1), len(prompt2)) and full1[common] == prompt2[common]:
        common += 1
    assert common > len(prompt1) + len(turn1.output_token_ids) // 2  # the template re-renders it
    computed1 = len(prompt1) + len(turn1.output_token_ids) - 1
    assert turn2.usage.cached_tokens == (min(common, computed1) // ps) * ps
    assert turn2.usage.cached_tokens > len(prompt1)
