"""Sparse mixture-of-experts block (Qwen3-MoE, Mixtral): a router picks `top_k` experts per token,
the experts run grouped by expert (tokens sorted by expert id, one GEMM pair per expert hit),
and the weighted outputs are summed back per token.

Routing numerics follow transformers: softmax over all experts in float32, top-k, renormalized
over the chosen k when `renormalize` (Mixtral always; Qwen3-MoE with `norm_topk_prob`), weights
cast to the activation dtype. Per token, contributions are added in increasing expert order, as
transformers does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.layer_ops import TORCH_OPS, LayerOps
from radixlm.runtime.quantization.weights import QuantizedWeight

# checkpoint projection name -> (stacked parameter, fused shard): Qwen3-MoE / Mixtral names
EXPERT_PROJECTIONS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
}


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, E] -> (weights [T, k] fp32, experts [T, k] int64)
    """Softmax-then-top-k routing (Mixtral, Qwen3-MoE)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Experts(nn.Module):
    """`num_experts` gated MLPs stacked: `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`
    (transformers 5.x's fused layout; per-expert checkpoint names are stacked at load)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.ops: LayerOps = TORCH_OPS

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        experts: torch.Tensor,  # [T, k] int64 expert ids
        weights: torch.Tensor,  # [T, k] routing weights
    ) -> torch.Tensor:  # [T, H]
        k = experts.shape[1]
        flat = experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # [T*k] rows grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // k  # [T*k] the token of each sorted row
        xs = x.index_select(0, token)  # [T*k, H]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            h = F.linear(xs[start : start + n], self.gate_up_proj[e])  # [n, 2I]
            ys[start : start + n] = F.linear(self.ops.silu_and_mul(h), self.down_proj[e])
            start += n
        ys = ys * weights.reshape(-1)[order].to(ys.dtype)[:, None]  # [T*k, H]
        return torch.zeros_like(x).index_add_(0, token, ys)

    def load_checkpoint_tensor(self, path: str, name: str, tensor: torch.Tensor) -> set[str]:
        """Load `path.<e>.<proj>.weight` (one expert) or `path.<gate_up_proj|down_proj>` (all
        stacked); returns the keys filled (see `expected_checkpoint_tensors`)."""
        if isinstance(tensor, QuantizedWeight):
            raise NotImplementedError("quantized (GGUF-mapped) MoE experts are not supported")
        rest = name[len(path) + 1 :].split(".")
        if len(rest) == 1 and rest[0] in ("gate_up_proj", "down_proj"):
            getattr(self, rest[0]).data.copy_(tensor)
            return {k for k in self.expected_checkpoint_tensors(path) if f".{rest[0]}[" in k}
        if len(rest) != 3 or rest[1] not in EXPERT_PROJECTIONS or rest[2] != "weight":
            raise KeyError(f"unexpected weight {name!r} in checkpoint")
        e = int(rest[0])
        target, shard = EXPERT_PROJECTIONS[rest[1]]
        rows = self.intermediate if target == "gate_up_proj" else tensor.shape[0]
        getattr(self, target).data[e, shard * rows : (shard + 1) * rows].copy_(tensor)
        return {f"{path}.{target}[{e}]#{shard}"}

    def expected_checkpoint_tensors(self, path: str) -> set[str]:
        keys = set()
        for e in range(self.num_experts):
            keys |= {f"{path}.gate_up_proj[{e}]#0", f"{path}.gate_up_proj[{e}]#1"}
            keys.add(f"{path}.down_proj[{e}]#0")
        return keys


class SparseMoeBlock(nn.Module):
    """Router (`gate`, no bias) + `experts`; `[T, H] -> [T, H]`. Under tensor parallelism each
    rank holds every expert's slice of the intermediate width and `all_reduce` sums the partial
    outputs (set by `distributed.sharding.parallelize`)."""

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)  # [T, k] each
        out = self.experts(x, experts, weights.to(x.dtype))
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out
