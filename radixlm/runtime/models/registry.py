"""Model families by the config's `architectures` name.

Each family is one module of this package defining its `*ForCausalLM` (a `base.DecoderLM`);
the table below maps architecture names to `module:class` and is read without importing any
family (so an unknown architecture is refused before anything loads).
"""

from __future__ import annotations

import importlib

from radixlm.runtime.errors import ConfigError

_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "OlmoeForCausalLM": "olmoe:OlmoeForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
}

# The Llama family (`llama.LlamaForCausalLM`): its layers ignore a config `sliding_window`
# (full attention everywhere), so its context is clamped to the window
# (`model_info.context_length`), within which that is exact.
_LLAMA_FAMILY = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

# Families whose checkpoint names `distributed.sharding` slices (q/k/v, gate/up, o, down,
# Phi-3's fused qkv / gate_up, MoE experts). Not OLMoE: its q/k norms span every head.
_TENSOR_PARALLEL = _LLAMA_FAMILY | {
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
}

# config `model_type` -> architecture, for configs without `architectures`
ARCH_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def check_architecture(architecture: str) -> None:
    """`ConfigError` naming `architecture` and the supported list when it is not served."""
    if architecture not in _FAMILIES:
        raise ConfigError(
            f"unsupported model architecture {architecture!r}; radixlm serves: "
            f"{', '.join(supported_architectures())}"
        )


def applies_sliding_window(architecture: str) -> bool:
    """Whether the family attends within each layer's window (so it serves its full context)."""
    return architecture not in _LLAMA_FAMILY


def check_tensor_parallel(architecture: str, tp_size: int) -> None:
    """`ConfigError` when `tp_size > 1` and the family cannot be sharded."""
    if tp_size > 1 and architecture not in _TENSOR_PARALLEL:
        raise ConfigError(
            f"tensor parallelism is not supported for {architecture!r} yet; it is for: "
            f"{', '.join(sorted(_TENSOR_PARALLEL))}"
        )


def check_quantization(architecture: str, quantization: str) -> None:
    """`ConfigError` for `quantization="gguf"` (a GGUF's blocks as they ship) on a family whose
    GGUF tensor names `quantization.gguf_reader` does not map (only the Llama family's)."""
    if quantization == "gguf" and architecture not in _LLAMA_FAMILY:
        raise ConfigError(
            f"quantization='gguf' maps the Llama family's GGUF tensors only, not "
            f"{architecture!r}: serve it dequantized, or with --quantization int8 / int4"
        )


def model_class(architecture: str) -> type:
    """The `DecoderLM` subclass serving `architecture` (imports its family module)."""
    check_architecture(architecture)
    module, name = _FAMILIES[architecture].split(":")
    return getattr(importlib.import_module(f"radixlm.runtime.models.{module}"), name)
