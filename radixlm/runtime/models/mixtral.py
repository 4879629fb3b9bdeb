"""Mixtral: Llama attention (its `sliding_window` applied to every layer when set), sparse MoE
MLPs (`block_sparse_moe`, experts `w1`/`w3`/`w2`) with softmax-then-top-k routing, the top-k
weights renormalized."""

from __future__ import annotations

from typing import Any

from torch import nn

from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.layers import Attention
from radixlm.runtime.models.llama import DecoderLayer
from radixlm.runtime.models.moe import SparseMoeBlock


class MixtralForCausalLM(DecoderLM):
    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        window = int(getattr(config, "sliding_window", None) or 0)
        attention = Attention(config, layer_id, self.head_dim, False, window=window)
        mlp = SparseMoeBlock(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            renormalize=True,
        )
        return DecoderLayer(
            config, layer_id, self.head_dim, False, False, attention=attention, mlp=mlp
        )

    def weight_renames(self, name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
