"""OLMoE: q/k RMSNorm over the whole projection (not per head), optional `clip_qkv`, and a
sparse MoE MLP on every layer (softmax-then-top-k, renormalized only with `norm_topk_prob`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.layers import Attention, RMSNorm
from radixlm.runtime.models.llama import DecoderLayer
from radixlm.runtime.models.moe import SparseMoeBlock


class OlmoeAttention(Attention):
    def __init__(self, config: Any, layer_id: int, head_dim: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_id, head_dim, bias, bias)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip = getattr(config, "clip_qkv", None)

    def project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, H] -> q [T, Hq, D], k, v
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous())  # [T, Hq * D]
        k = self.k_norm(k.contiguous())  # [T, Hkv * D]
        if self.clip is not None:
            q, k, v = (z.clamp(-self.clip, self.clip) for z in (q, k, v))
        t = x.shape[0]
        return (
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.reshape(t, self.num_kv_heads, self.head_dim),
        )


class OlmoeForCausalLM(DecoderLM):
    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        mlp = SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            config.num_experts,
            config.num_experts_per_tok,
            bool(getattr(config, "norm_topk_prob", False)),
        )
        attention = OlmoeAttention(config, layer_id, self.head_dim)
        return DecoderLayer(
            config, layer_id, self.head_dim, False, False, attention=attention, mlp=mlp
        )
