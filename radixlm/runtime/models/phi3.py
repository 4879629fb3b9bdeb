"""Phi-3: the Llama layer with checkpoint projections already fused (`qkv_proj`,
`gate_up_proj`), LongRoPE (`su`) scaling when the config has it (`layers.RotaryEmbedding`), and
its `sliding_window` applied to every layer when set."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from radixlm.runtime.models.base import DecoderLM
from radixlm.runtime.models.layers import Attention
from radixlm.runtime.models.llama import DecoderLayer


class Phi3ForCausalLM(DecoderLM):
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {}  # the checkpoint is fused already

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        window = int(getattr(config, "sliding_window", None) or 0)
        attention = Attention(config, layer_id, self.head_dim, False, window=window)  # no biases
        return DecoderLayer(config, layer_id, self.head_dim, False, False, attention=attention)
