"""Fixtures for end-to-end tests on the real default model (float32, token-exact vs HF)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SENTENCES = [
    "The radix tree stores each prompt by its tokens, so requests sharing a prefix share memory.",
    "In the morning the fishermen pulled their boats onto the sand and sorted the silver catch.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "She opened the old notebook and found a map drawn in faded blue ink.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Les montagnes étaient couvertes de neige et le ciel était d'un bleu profond.",
    "Rain fell softly on the tin roof while the kettle began to whistle.",
    "A balanced diet includes vegetables, fruits, whole grains and enough water.",
]


def make_prompt_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """Real text of exactly `n_tokens` tokens (varied, so greedy outputs are not degenerate)."""
    ids: list[int] = []
    i = seed
    while len(ids) < n_tokens:
        ids += tokenizer.encode(SENTENCES[i % len(SENTENCES)] + " ", add_special_tokens=False)
        i += 3
    return ids[:n_tokens]


PROMPT_LENGTHS = [5, 9, 17, 33, 64, 100, 150, 230, 300, 420, 512, 600]
NEW_TOKENS = 12


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path):
    from radixlm.runtime.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def mixed_prompts(tokenizer) -> list[list[int]]:
    prompts = [make_prompt_ids(tokenizer, n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]
    # Two prompts share a 200-token prefix with a third, so the radix cache has work to do.
    prompts.append(prompts[8][:200] + make_prompt_ids(tokenizer, 40, 5))
    prompts.append(prompts[8][:208] + make_prompt_ids(tokenizer, 7, 6))
    return prompts


@pytest.fixture(scope="session")
def hf_reference(default_model_dir: Path, mixed_prompts) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, run one by one in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in mixed_prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=2,
            )
            outs.append(y[0, len(ids) :].tolist())
    del model
    return outs
