"""Fixtures for end-to-end tests on the real default model (float32, token-exact vs HF)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from e2e_prompts import NEW_TOKENS, PROMPT_LENGTHS, make_prompt_ids


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
