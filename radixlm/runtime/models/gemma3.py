"""Gemma 3 (text): GeGLU MLP, embeddings scaled by `sqrt(hidden)`, RMSNorm by `(1 + w)` (the
offset added at load), per-head q/k norm, four norms per layer (pre/post attention, pre/post
MLP), logits scaled by `query_pre_attn_scalar ** -0.5`, and interleaved sliding-window layers
(`layer_types`) whose RoPE base (`rope_local_base_freq`) differs from the global layers'.
Final-logit soft-capping applies when the config sets it. NOTE: `attn_logit_softcapping` is
not applied, as in transformers' Gemma 3 (Gemma 2 applied it; Gemma 3 configs leave it None)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.errors import ConfigError
from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding
from radixlm.runtime.models.qwen3 import layer_window

GLOBAL, LOCAL = "full_attention", "sliding_attention"


def _norm(config: Any, dim: int) -> RMSNorm:
    return RMSNorm(dim, config.rms_norm_eps, weight_offset=1.0)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, head_dim: int) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = Attention(
            config, layer_id, head_dim, bias, bias,
            qk_norm=_norm(config, head_dim),
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            window=layer_window(config, layer_id),
        )  # fmt: skip
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        self.mlp = MLP(config.hidden_size, config.intermediate_size, False, act)
        h = config.hidden_size
        self.input_layernorm = _norm(config, h)
        self.post_attention_layernorm = _norm(config, h)
        self.pre_feedforward_layernorm = _norm(config, h)
        self.post_feedforward_layernorm = _norm(config, h)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] the previous layer's (post-normed) MLP output
        residual: torch.Tensor | None,  # [T, H] the stream before x is added (None: layer 0)
        batch: ForwardBatch,
        rope: RotaryEmbedding,
        attn,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (post-normed MLP output, stream without it)
        residual = x if residual is None else residual + x  # [T, H]
        h = self.self_attn(self.input_layernorm(residual), batch, rope, attn)
        residual = residual + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(h), residual


class Gemma3ForCausalLM(DecoderLM):
    def __init__(self, config: Any, max_positions: int | None = None) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ConfigError("Gemma 3 with bidirectional attention (an encoder) is not served")
        super().__init__(config, max_positions)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.final_logit_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        return Gemma3DecoderLayer(config, layer_id, self.head_dim)

    def make_norm(self, dim: int) -> RMSNorm:
        return _norm(self.config, dim)

    def build_rope(self, config: Any, max_positions: int, device: torch.device | None = None):
        """Global layers' tables in `rotary`, sliding layers' (their own base) in `rotary_local`."""
        types = getattr(config, "layer_types", None) or [GLOBAL] * config.num_hidden_layers
        self.layer_types = list(types)
        self.rotary = RotaryEmbedding(config, self.head_dim, max_positions, GLOBAL)
        self.rotary_local = RotaryEmbedding(config, self.head_dim, max_positions, LOCAL)
        if device is not None:
            for rope in (self.rotary, self.rotary_local):
                rope.to(device)
                rope.ops = self.layer_ops

    def rope_for(self, layer_id: int) -> RotaryEmbedding:
        return self.rotary_local if self.layer_types[layer_id] == LOCAL else self.rotary
