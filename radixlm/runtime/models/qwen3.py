"""Qwen3: the Llama layer with per-head q/k RMSNorm (before RoPE) and `head_dim` from the
config; no q/k/v bias unless `attention_bias`."""

from __future__ import annotations

from typing import Any

from torch import nn

from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.layers import Attention, RMSNorm
from radixlm.runtime.models.llama import DecoderLayer


def qk_norm_attention(config: Any, layer_id: int, head_dim: int) -> Attention:
    """Qwen3-style attention: q/k/v/o bias per `attention_bias`, per-head q/k RMSNorm, the
    layer's sliding window."""
    bias = bool(getattr(config, "attention_bias", False))
    norm = RMSNorm(head_dim, config.rms_norm_eps)
    window = layer_window(config, layer_id)
    return Attention(config, layer_id, head_dim, bias, bias, qk_norm=norm, window=window)


def layer_window(config: Any, layer_id: int) -> int:
    """The sliding window of layer `layer_id` (0: full attention), from `layer_types`."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or not types or getattr(config, "use_sliding_window", True) is False:
        return 0
    return int(window) if types[layer_id] == "sliding_attention" else 0


class Qwen3ForCausalLM(DecoderLM):
    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        attention = qk_norm_attention(config, layer_id, self.head_dim)
        return DecoderLayer(config, layer_id, self.head_dim, False, False, attention=attention)
