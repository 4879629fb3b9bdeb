"""The pieces every decoder family is built from: RMSNorm, rotary embeddings (every rope type and
scaling transformers knows, per layer type), the gated MLP and the attention wrapper over the
paged attention backend.

Numerics mirror Hugging Face transformers (RMSNorm in float32 then cast, RoPE cos/sin computed
in float32), so float32 runs are token-identical to `generate`. The elementwise math is the one
copy in `radixlm.kernels.reference` (through the model's `LayerOps`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kernels.layer_ops import TORCH_OPS, LayerOps
from radixlm.kernels.reference import gelu_tanh_and_mul_ref


class RMSNorm(nn.Module):
    """`weight * normalize(x)`. `weight_offset`: added to the checkpoint's weight when it is
    loaded (Gemma stores `w` and multiplies by `1 + w`)."""

    def __init__(self, dim: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_offset = weight_offset
        self.ops: LayerOps = TORCH_OPS  # set by `DecoderLM.set_layer_ops`

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, H]; with `residual`: residual <- x + residual, normalized
        return self.ops.rms_norm(x, self.weight, self.eps, residual)

    def per_head(self, x: torch.Tensor) -> torch.Tensor:  # [T, heads, D] -> [T, heads, D]
        """Normalize each head's vector (Qwen3 / Gemma 3 q/k norm)."""
        t, h, d = x.shape
        return self.ops.rms_norm(x.reshape(t * h, d), self.weight, self.eps).view(t, h, d)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope parameters (transformers 5.x `rope_parameters`, 4.x `rope_theta` +
    `rope_scaling`); `layer_type` picks one of per-layer-type parameters (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params.get("full_attention") or next(iter(params.values())))
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    return params


def rope_inv_freq(
    config: Any, head_dim: int, layer_type: str | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[D/2]` and the cos/sin scaling of the config's rope type.
    `seq_len`: for LongRoPE, which factors apply (long beyond the original context)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if float(partial or 1.0) != 1.0:
        raise ValueError(f"partial rotary embeddings (factor {partial}) are not supported")
    if rope_type == "default":
        theta = params["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    kwargs: dict[str, Any] = {}
    if layer_type is not None:
        kwargs["layer_type"] = layer_type
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv.float(), float(scaling)


def _cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor):
    freqs = torch.outer(positions.float(), inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos() * scaling, emb.sin() * scaling


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 cos/sin tables `[P, D]` indexed by absolute position (neox-style
    rotate-half); the layer-op set reads the rows of a step's positions.

    LongRoPE (Phi-3): positions below `original_max_position_embeddings` use the short factors
    and the ones beyond use the long factors. NOTE: transformers switches a whole sequence to
    the long factors once it grows past the original context (re-rotating nothing already
    cached); within the original context both agree exactly.
    """

    def __init__(
        self, config: Any, head_dim: int, max_positions: int, layer_type: str | None = None
    ) -> None:
        super().__init__()
        with torch.device("cpu"):  # real tables even when the model is built on meta
            params = rope_parameters(config, layer_type)
            t = torch.arange(max_positions, dtype=torch.float32)
            if params.get("rope_type") == "longrope":
                orig = int(
                    params.get("original_max_position_embeddings")
                    or getattr(config, "original_max_position_embeddings", max_positions)
                )
                short = _cos_sin(*rope_inv_freq(config, head_dim, layer_type, orig), t)
                long = _cos_sin(*rope_inv_freq(config, head_dim, layer_type, orig + 1), t)
                is_long = (t >= orig)[:, None]  # [P, 1]
                cos = torch.where(is_long, long[0], short[0])
                sin = torch.where(is_long, long[1], short[1])
            else:
                cos, sin = _cos_sin(*rope_inv_freq(config, head_dim, layer_type), t)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.ops: LayerOps = TORCH_OPS

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D] (maybe in place)
        return self.ops.rope(positions, q, k, self.cos, self.sin)


class MLP(nn.Module):
    """Gated MLP `down(act(gate(x)) * up(x))` with gate and up fused (`gate_up_proj`).
    `act`: `silu` (through the layer ops) or `gelu_pytorch_tanh` (GeGLU, Gemma)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r}")
        self.intermediate = intermediate
        self.act = act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.ops: LayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if getattr(self.gate_up_proj, "gated", False):  # SiLU-and-mul fused (`PackedLinear`)
            return self.down_proj(self.gate_up_proj(x))
        h = self.gate_up_proj(x)  # [T, 2I]
        h = self.ops.silu_and_mul(h) if self.act == "silu" else gelu_tanh_and_mul_ref(h)
        return self.down_proj(h)


class Attention(nn.Module):
    """q/k/v (fused `qkv_proj`), optional per-head q/k RMSNorm, RoPE, paged attention, o_proj.

    `window` > 0: a sliding-window layer (a query at position p sees keys > p - window);
    `softcap` > 0: attention logits capped as `softcap * tanh(s / softcap)`; `scale`: the
    logits' scale (default `head_dim ** -0.5`).
    """

    def __init__(
        self,
        config: Any,
        layer_id: int,
        head_dim: int,
        bias: bool,
        out_bias: bool = False,
        *,
        qk_norm: RMSNorm | None = None,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=out_bias)
        self.scale = scale if scale is not None else head_dim**-0.5
        if qk_norm is not None:
            self.q_norm = qk_norm
            self.k_norm = RMSNorm(head_dim, qk_norm.eps, qk_norm.weight_offset)
        else:
            self.q_norm = self.k_norm = None
        self.window = int(window or 0)
        self.softcap = float(softcap or 0.0)
        # NOTE: only non-default options are passed, so a backend without them still serves
        # the plain layers.
        self._attn_kwargs: dict[str, Any] = {}
        if self.window:
            self._attn_kwargs["window"] = self.window
        if self.softcap:
            self._attn_kwargs["softcap"] = self.softcap

    def project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, H] -> q [T, Hq, D], k, v
        """q, k, v by head, before RoPE (q/k normalized per head when the layer has norms)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm.per_head(q), self.k_norm.per_head(k)
        return q, k, v

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: RotaryEmbedding, attn
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        t = x.shape[0]
        q, k, v = self.project(x)
        q, k = rope(batch.positions, q, k)
        o = attn.forward(self.layer_id, q, k, v, self.scale, **self._attn_kwargs)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
