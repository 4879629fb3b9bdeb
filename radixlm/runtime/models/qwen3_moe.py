"""Qwen3-MoE: Qwen3 attention; sparse MoE MLPs (`norm_topk_prob` renormalizes the top-k
weights) on every `decoder_sparse_step`-th layer not in `mlp_only_layers`, dense ones
elsewhere."""

from __future__ import annotations

from typing import Any

from torch import nn

from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.llama import DecoderLayer
from radixlm.runtime.models.moe import SparseMoeBlock
from radixlm.runtime.models.qwen3 import qk_norm_attention


class Qwen3MoeForCausalLM(DecoderLM):
    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        attention = qk_norm_attention(config, layer_id, self.head_dim)
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        sparse = (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_id + 1) % step == 0
        )
        mlp = None
        if sparse:
            mlp = SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                bool(config.norm_topk_prob),
            )
        return DecoderLayer(
            config, layer_id, self.head_dim, False, False, attention=attention, mlp=mlp
        )
