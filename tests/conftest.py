"""Shared test fixtures: the real default model and tiny random-weight models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a model hub

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from radixlm.runtime.models.loader import resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session", autouse=True)
def _single_torch_thread() -> Iterator[None]:
    """The test machines have 2 shared cores; torch's default threading slows small ops ~100x."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); prepared once per machine."""
    return resolve_model_path(None)


def _write_tiny_model(
    out_dir: Path, tokenizer_dir: Path, model_type: str, seed: int, **overrides: Any
) -> Path:
    """Save a tiny random-weight causal LM plus a copy of ``tokenizer_dir``'s tokenizer.

    Norm weights and biases are randomized too (HF initializes them to 1 / 0), so a model that
    forgets to apply one of them disagrees with transformers.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    params: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=49152,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    params.update(overrides)
    config = AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def make_tiny_model(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Callable[..., Path]:
    """Factory: `make_tiny_model(model_type, seed, **config overrides)` saves a random-weight
    model (the default model's tokenizer, norms randomized) and returns its directory."""

    def make(model_type: str, seed: int, **overrides: Any) -> Path:
        out = tmp_path_factory.mktemp(f"tiny_{model_type}")
        return _write_tiny_model(out, default_model_dir, model_type, seed, **overrides)

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Tiny LlamaForCausalLM (hidden 64, 2 layers, 4 heads / 2 kv heads, tied embeddings) with
    the default model's tokenizer (vocab 49152)."""
    out = tmp_path_factory.mktemp("tiny_llama")
    return _write_tiny_model(
        out, default_model_dir, "llama", seed=0, tie_word_embeddings=True, rope_theta=10000.0
    )


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Tiny Llama with one KV head (multi-query attention) and an untied lm_head."""
    out = tmp_path_factory.mktemp("tiny_mqa")
    return _write_tiny_model(
        out, default_model_dir, "llama", seed=1, num_key_value_heads=1, tie_word_embeddings=False
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Tiny Qwen2ForCausalLM: q/k/v biases (no o_proj bias), untied lm_head, same tokenizer."""
    out = tmp_path_factory.mktemp("tiny_qwen2")
    return _write_tiny_model(
        out,
        default_model_dir,
        "qwen2",
        seed=1,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )


@pytest.fixture(scope="session")
def tiny_llama_bias_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """Tiny Llama with `attention_bias=True`: biases on q/k/v and o_proj."""
    out = tmp_path_factory.mktemp("tiny_llama_bias")
    return _write_tiny_model(out, default_model_dir, "llama", seed=3, attention_bias=True)
