"""Llama family (Llama 2/3, Mistral without its window, Qwen2, SmolLM2): the reference decoder
layer, and the one family the compiled CPU layer stack (`cpu_stack.CpuDecoderStack`) runs.

Q/K/V and gate/up projections are fused at load time (`base.LLAMA_FUSED`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.layers import MLP, Attention, RMSNorm, RotaryEmbedding

__all__ = ["DecoderLayer", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding"]


class DecoderLayer(nn.Module):
    """Pre-norm layer: `x + attn(norm(x))`, then `+ mlp(norm(.))`, each norm fused with the
    residual add. `attention`/`mlp`: a family's own modules (default: Llama's)."""

    def __init__(
        self,
        config: Any,
        layer_id: int,
        head_dim: int,
        attn_bias: bool,
        mlp_bias: bool,
        out_bias: bool = False,
        *,
        attention: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = attention or Attention(config, layer_id, head_dim, attn_bias, out_bias)
        self.mlp = mlp or MLP(config.hidden_size, config.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, H] the previous layer's MLP output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, H] the stream before x is added (None: layer 0)
        batch: ForwardBatch,
        rope: RotaryEmbedding,
        attn,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream without it)
        """The residual stream is `residual + x`; each norm adds its input into `residual` in the
        same pass (rounded to the activation dtype, as the eager `x = x + h`)."""
        if residual is None:
            residual = x  # the embeddings: a fresh tensor, updated in place from here on
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.self_attn(h, batch, rope, attn)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(DecoderLM):
    """Llama-family causal LM (the compiled CPU stack applies)."""

    CPU_STACK = True  # NOTE: Mistral's window is not applied (`registry.applies_sliding_window`)

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        from radixlm.runtime.models.model_info import attention_biases

        attn_bias, out_bias = attention_biases(config)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        return DecoderLayer(config, layer_id, self.head_dim, attn_bias, mlp_bias, out_bias)
