"""Megatron-style sharding of the decoder families (`runtime.models.registry` says which), done
while the checkpoint is read.

Per decoder layer, rank `r` of `tp` holds:

- `qkv_proj` (column parallel): its `num_heads / tp` query heads and its KV heads. KV heads are
  split when `tp` divides them; when `tp` is a multiple of them, each KV head is replicated on
  `tp / num_kv_heads` consecutive ranks (vLLM's rule: rank `r` holds KV head
  `r // (tp / num_kv_heads)`, the one its query heads attend to). Anything else is refused.
- `o_proj` (row parallel): the matching input columns; one all-reduce of its output.
- `gate_up_proj` (column parallel): `intermediate / tp` rows of gate and of up. Checkpoints
  that ship `qkv_proj` / `gate_up_proj` fused (Phi-3) are cut into their parts, each sliced.
- `down_proj` (row parallel): the matching input columns; one all-reduce; its bias (if any) is
  added once, after the reduction.

The embedding and the LM head are replicated, not vocab-parallel: rank 0 samples (grammar masks,
penalties, logprobs) from full logits, which a vocab-parallel head would have to gather to rank 0
every step; replicated, a step has exactly the two all-reduces per layer and nothing else. The
cost is one `vocab x hidden` matrix per rank (tied models: one in all).

The model class is not changed: it is built from a per-rank config (`num_attention_heads`,
`num_key_value_heads`, `intermediate_size` divided), so every local shape is the shard's, and the
two row-parallel projections are swapped for `RowParallelLinear`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.parallel_state import TensorParallelGroup
from radixlm.runtime.errors import ConfigError


@dataclass(frozen=True)
class ShardSpec:
    """What rank `rank` of `tp_size` holds of a model with the given head counts."""

    tp_size: int
    rank: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int = 0  # an expert's width where it differs (Qwen3-MoE); 0: none

    def __post_init__(self) -> None:
        tp = self.tp_size
        if self.num_heads % tp:
            raise ConfigError(
                f"tp_size {tp} must divide the number of attention heads ({self.num_heads})"
            )
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ConfigError(
                f"tp_size {tp} must divide the number of KV heads ({self.num_kv_heads}) or be a "
                "multiple of it (KV heads are then replicated)"
            )
        if self.intermediate_size % tp:
            raise ConfigError(
                f"tp_size {tp} must divide intermediate_size ({self.intermediate_size})"
            )
        if self.moe_intermediate_size % tp:
            raise ConfigError(
                f"tp_size {tp} must divide moe_intermediate_size ({self.moe_intermediate_size})"
            )

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.tp_size, 1)

    @property
    def kv_replicas(self) -> int:
        """Ranks sharing one KV head (1: KV heads are split)."""
        return max(self.tp_size // self.num_kv_heads, 1)

    @property
    def kv_head_start(self) -> int:
        return self.rank // self.kv_replicas * self.local_kv_heads

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def local_expert_intermediate(self) -> int:
        return (self.moe_intermediate_size or self.intermediate_size) // self.tp_size


def shard_spec(hf_config: Any, tp_size: int, rank: int) -> ShardSpec:
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return ShardSpec(
        tp_size=tp_size,
        rank=rank,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=hf_config.intermediate_size,
        moe_intermediate_size=int(getattr(hf_config, "moe_intermediate_size", None) or 0),
    )


def shard_config(hf_config: Any, spec: ShardSpec) -> Any:
    """A copy of the config whose head counts and MLP width are this rank's."""
    cfg = copy.deepcopy(hf_config)
    cfg.head_dim = spec.head_dim  # NOTE: before the head count changes hidden // heads
    cfg.num_attention_heads = spec.local_heads
    cfg.num_key_value_heads = spec.local_kv_heads
    cfg.intermediate_size = spec.local_intermediate
    if spec.moe_intermediate_size:
        cfg.moe_intermediate_size = spec.moe_intermediate_size // spec.tp_size
    return cfg


class RowParallelLinear(nn.Linear):
    """`y = all_reduce(x_shard @ W_shard^T) + b`: input features split across ranks."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/tp] -> [T, out]
        y = F.linear(x, self.weight)
        self.group.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def parallelize(model: nn.Module, group: TensorParallelGroup) -> None:
    """Swap each layer's o_proj and down_proj for row-parallel ones (same shapes and names); a
    sparse MoE block (each rank holds every expert's `1 / tp` slice) all-reduces its output.
    Call on the model built from `shard_config`, before its weights are materialized."""
    for layer in model.layers:
        pairs = [(layer.self_attn, "o_proj")]
        if hasattr(layer.mlp, "down_proj"):
            pairs.append((layer.mlp, "down_proj"))
        else:
            layer.mlp.all_reduce = group.all_reduce
        for parent, name in pairs:
            old: nn.Linear = getattr(parent, name)
            with torch.device(old.weight.device):
                new = RowParallelLinear(
                    old.in_features, old.out_features, old.bias is not None, group
                )
            setattr(parent, name, new.to(old.weight.dtype))


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t.narrow(0, start, size)


def _cols(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t.narrow(-1, start, size)


def shard_tensor(name: str, tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's slice of one checkpoint tensor (Hugging Face name); replicated ones whole."""
    parts = name.split(".")
    if len(parts) < 2:
        return tensor
    module, kind = parts[-2], parts[-1]
    d, r = spec.head_dim, spec.rank
    if "experts" in parts:  # a sparse MoE expert: its width sliced like a dense MLP's
        return _shard_expert(module, kind, tensor, spec)
    if module == "qkv_proj":  # checkpoint-fused (Phi-3): [q | k | v] rows, each sliced
        q_size, kv_size = spec.num_heads * d, spec.num_kv_heads * d
        q, k, v = tensor.split([q_size, kv_size, kv_size])
        return torch.cat([shard_tensor(f"{p}.{kind}", t, spec) for p, t in
                          (("q_proj", q), ("k_proj", k), ("v_proj", v))])  # fmt: skip
    if module == "gate_up_proj":  # checkpoint-fused (Phi-3): [gate | up] rows, each sliced
        gate, up = tensor.chunk(2)
        return torch.cat([shard_tensor(f"gate_proj.{kind}", gate, spec),
                          shard_tensor(f"up_proj.{kind}", up, spec)])  # fmt: skip
    if module == "q_proj":
        return _rows(tensor, r * spec.local_heads * d, spec.local_heads * d)
    if module in ("k_proj", "v_proj"):
        return _rows(tensor, spec.kv_head_start * d, spec.local_kv_heads * d)
    if module in ("gate_proj", "up_proj"):
        return _rows(tensor, r * spec.local_intermediate, spec.local_intermediate)
    if module == "o_proj" and kind == "weight":
        return _cols(tensor, r * spec.local_heads * d, spec.local_heads * d)
    if module == "down_proj" and kind == "weight":
        return _cols(tensor, r * spec.local_intermediate, spec.local_intermediate)
    return tensor  # embeddings, norms, lm_head, row-parallel biases


# expert projection (per-expert checkpoint names, Mixtral's w1/w3/w2) -> rows (column parallel)
_EXPERT_ROWS = {"gate_proj", "up_proj", "w1", "w3"}
_EXPERT_COLS = {"down_proj", "w2"}


def _shard_expert(module: str, kind: str, tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's slice of one expert tensor: per expert (`experts.<e>.<proj>.weight`) or all
    stacked (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`)."""
    width, r = spec.local_expert_intermediate, spec.rank
    if module in _EXPERT_ROWS:
        return _rows(tensor, r * width, width)
    if module in _EXPERT_COLS:
        return _cols(tensor, r * width, width)
    if kind == "gate_up_proj":
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([gate.narrow(1, r * width, width), up.narrow(1, r * width, width)], 1)
    if kind == "down_proj":
        return _cols(tensor, r * width, width)
    raise ValueError(f"cannot shard expert tensor {module}.{kind}")


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], spec: ShardSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Slice each tensor as it is read; only this rank's shard is ever copied to the device."""
    for name, tensor in weights:
        yield name, shard_tensor(name, tensor, spec)
