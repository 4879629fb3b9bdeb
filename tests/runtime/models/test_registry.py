"""The model registry: every family by its `architectures` name, and an unknown architecture
refused with a `ConfigError` naming it and the supported list before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from radixlm.config import CacheConfig
from radixlm.runtime.errors import ConfigError
from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.registry import (
    applies_sliding_window,
    check_quantization,
    model_class,
    supported_architectures,
)


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_family_is_a_decoder_lm(arch: str) -> None:
    assert issubclass(model_class(arch), DecoderLM)


def test_only_the_llama_family_clamps_to_its_window() -> None:
    assert not applies_sliding_window("MistralForCausalLM")
    assert applies_sliding_window("Gemma3ForCausalLM")


@pytest.fixture
def unknown_arch_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "unknown"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _no_weights(*args, **kwargs):
    raise AssertionError("weights were read for an unknown architecture")


def test_unknown_architecture_runner(unknown_arch_dir: Path, monkeypatch) -> None:
    from radixlm.runtime import model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "_checkpoint", _no_weights)
    with pytest.raises(ConfigError, match="FooBarForCausalLM") as err:
        model_runner.ModelRunner(
            unknown_arch_dir, "float32", torch.device("cpu"), CacheConfig(num_pages=8)
        )
    assert "Gemma3ForCausalLM" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)


def test_unknown_architecture_engine(unknown_arch_dir: Path, monkeypatch) -> None:
    from radixlm import Engine
    from radixlm.runtime import core_factory

    monkeypatch.setattr(core_factory, "ModelRunner", _no_weights)
    with pytest.raises(ConfigError, match="unsupported model architecture 'FooBarForCausalLM'"):
        Engine(str(unknown_arch_dir), dtype="float32", num_pages=8)


def test_gguf_blocks_only_for_the_llama_family() -> None:
    check_quantization("LlamaForCausalLM", "gguf")
    check_quantization("Gemma3ForCausalLM", "int8")
    with pytest.raises(ConfigError, match="gguf"):
        check_quantization("Gemma3ForCausalLM", "gguf")
