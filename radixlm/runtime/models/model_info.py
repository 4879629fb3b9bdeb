"""What the runtime needs from a model's ``config.json``: `ModelInfo`, normalized across
transformers 4.x / 5.x config shapes (RoPE parameters, implicit biases, eos ids, sliding
window), and the context length the engine serves."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.models.registry import ARCH_BY_MODEL_TYPE, applies_sliding_window

logger = logging.getLogger(__name__)

# model_types whose q/k/v projections carry a bias without a config field saying so.
_IMPLICIT_QKV_BIAS = frozenset({"qwen2"})


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs from config.json, normalized across transformers 4.x / 5.x."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # {"rope_type": "llama3"|"linear"|..., ...}; None: plain
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2: True)
    attention_out_bias: bool  # bias on o_proj (Llama attention_bias=True: yes; Qwen2: no)
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    # Sliding-window attention span (Mistral), None when the model attends to everything.
    sliding_window: int | None = None
    # The parsed transformers config (read once; the model's constructor takes it).
    hf_config: Any = field(default=None, compare=False, repr=False)


def load_model_info(model_dir: Path) -> ModelInfo:
    """Read ``config.json`` (+ ``generation_config.json``) of a local model directory."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    model_type = str(getattr(config, "model_type", ""))
    archs = getattr(config, "architectures", None) or []
    architecture = archs[0] if archs else ARCH_BY_MODEL_TYPE.get(model_type)
    if architecture is None:
        raise ValueError(f"cannot tell the architecture of {model_dir} (model_type={model_type!r})")

    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None)
    theta, scaling = _rope(config)
    qkv_bias, out_bias = attention_biases(config)
    bos, eos = _special_ids(config, model_dir)
    return ModelInfo(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(config.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(kv_heads) if kv_heads is not None else heads,
        head_dim=int(head_dim) if head_dim else hidden // heads,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.max_position_embeddings),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        attention_out_bias=out_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        bos_token_id=bos,
        eos_token_ids=eos,
        torch_dtype=_dtype_name(config),
        sliding_window=_sliding_window(config),
        hf_config=config,
    )


def _sliding_window(config: Any) -> int | None:
    """The attention window of a sliding-window model (Mistral's `sliding_window`; Qwen2 only
    with `use_sliding_window: true`); None for full attention."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def context_length(info: ModelInfo, requested: int | None) -> int:
    """The context length the engine serves: `requested` (default: the model's maximum).

    NOTE: families that apply their sliding windows (`registry.applies_sliding_window`) serve
    their full context. The Llama family ignores a window (Mistral); within the window, full
    attention is exactly what the model computes, so its context is clamped to the window by
    default, and asking for more is a `ValueError`.
    """
    limit = info.max_position_embeddings
    window = info.sliding_window
    if window is not None and window < limit and not applies_sliding_window(info.architecture):
        if requested is not None and requested > window:
            raise ValueError(
                f"max_model_len {requested} exceeds the model's sliding attention window "
                f"({window} tokens): sliding-window attention is not supported, so the context "
                f"is limited to the window; use --max-model-len {window} or less"
            )
        if requested is None:
            logger.warning(
                "%s uses sliding-window attention (window %d) which radixlm does not implement; "
                "serving a context of %d tokens (full attention within the window is exact)",
                info.architecture,
                window,
                window,
            )
        limit = window
    return min(limit, requested or limit)


def attention_biases(config: Any) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o_proj): Llama's `attention_bias` means both; Qwen2 has q/k/v
    biases without a config field saying so, and none on o_proj."""
    if str(getattr(config, "model_type", "")) in _IMPLICIT_QKV_BIAS:
        return True, False
    value = bool(getattr(config, "attention_bias", False))
    return value, value


def _rope(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling) from a 4.x (rope_theta + rope_scaling) or 5.x
    (rope_parameters) config."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type parameters (e.g. {"full_attention": {...}, ...}): use full attention's.
        nested = [v for v in params.values() if isinstance(v, dict)]
        params = params.get("full_attention", nested[0] if nested else params)
    scaling: dict[str, Any] | None = None
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        scaling = dict(params)
    else:
        theta = getattr(config, "rope_theta", None)
        raw = getattr(config, "rope_scaling", None)
        scaling = dict(raw) if isinstance(raw, dict) else None
    return float(theta if theta is not None else 10000.0), normalize_rope_scaling(scaling)


def normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """``{"rope_type": ..., **params}`` without ``rope_theta``; None for plain (default) RoPE."""
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return None
    out["rope_type"] = str(rope_type)
    return out


def _special_ids(config: Any, model_dir: Path) -> tuple[int | None, tuple[int, ...]]:
    """bos id and the union (in order) of eos ids from config.json and generation_config.json."""
    gen: dict[str, Any] = {}
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
    eos: list[int] = []
    for value in (getattr(config, "eos_token_id", None), gen.get("eos_token_id")):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
    bos = getattr(config, "bos_token_id", None)
    if bos is None:
        bos = gen.get("bos_token_id")
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return (int(bos) if bos is not None else None), tuple(eos)


def _dtype_name(config: Any) -> str | None:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(dtype)
