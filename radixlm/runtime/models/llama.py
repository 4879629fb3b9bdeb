"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over paged attention.

Numerics mirror Hugging Face transformers' implementation (RMSNorm in float32 then cast, RoPE
cos/sin computed in float32 and cast to the activation dtype) so that float32 runs are
token-identical to `generate`. Q/K/V and gate/up projections are fused at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kernels.layer_ops import TORCH_OPS, LayerOps
from radixlm.runtime.quantization.weights import QuantizedWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: LayerOps = TORCH_OPS  # set by `LlamaForCausalLM.set_layer_ops`

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:  # [T, H]; with `residual`: residual <- x + residual, normalized
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling for the config's rope type (incl. scaling)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Precomputed fp32 cos/sin tables `[P, D]` indexed by absolute position (neox-style
    rotate-half); the layer-op set reads the rows of a step's positions."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        with torch.device("cpu"):  # real tables even when the model is built on meta
            inv_freq, scaling = rope_inv_freq(config, head_dim)
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.ops: LayerOps = TORCH_OPS

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D] (maybe in place)
        return self.ops.rope(positions, q, k, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(
        self, config, layer_id: int, head_dim: int, bias: bool, out_bias: bool = False
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
        self.scale = head_dim**-0.5

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: RotaryEmbedding, attn
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = x.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(batch.positions, q, k)
        o = attn.forward(self.layer_id, q, k, v, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.ops: LayerOps = TORCH_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config,
        layer_id: int,
        head_dim: int,
        attn_bias: bool,
        mlp_bias: bool,
        out_bias: bool = False,
    ):
        super().__init__()
        self.self_attn = Attention(config, layer_id, head_dim, attn_bias, out_bias)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, mlp_bias)
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


class LlamaForCausalLM(nn.Module):
    """Causal LM whose forward consumes a ragged `ForwardBatch` and returns selected logits."""

    def __init__(self, config, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        from radixlm.runtime.models.model_info import attention_biases

        attn_bias, out_bias = attention_biases(config)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.head_dim = head_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, head_dim, attn_bias, mlp_bias, out_bias)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(
            config, head_dim, max_positions or config.max_position_embeddings
        )
        # `CpuDecoderStack` (set by the runner): the layers as one compiled call; None: Python
        self.stack = None

    def set_layer_ops(self, ops: LayerOps) -> None:
        """Run the norms, RoPE and SiLU-and-mul through `ops` (`radixlm.kernels.layer_ops`:
        the torch twins by default, fused C++ ops on CPU, Triton on CUDA)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, MLP)):
                module.ops = ops

    @property
    def layer_ops(self) -> LayerOps:
        return self.norm.ops

    def tie_weights(self) -> None:
        """Share lm_head with the embedding (again after `to_empty`, which unties)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn) -> torch.Tensor:  # [R, V] float32
        x = self.embed_tokens(batch.input_ids)  # [T, H]
        if self.stack is not None and self.stack.takes(x.shape[0]):  # the same ops, one call
            x, residual = self.stack(x, batch)
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, batch, self.rotary, attn)
        rows = batch.logits_indices
        x = self.norm(x[rows], residual[rows])  # [R, H]
        return self.lm_head(x).float()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> dict[str, list[QuantizedWeight]]:
        """Load Hugging Face names, fusing q/k/v and gate/up. Missing weights are an error.
        `QuantizedWeight`s (a GGUF's blocks) are returned, not loaded: module path -> its fused
        parts in order, for `radixlm.runtime.quantization.install_quantized`."""
        params = dict(self.named_parameters())
        staged: dict[str, dict[int, QuantizedWeight]] = {}  # module path -> fused parts
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                param = params[pname]
                if isinstance(tensor, QuantizedWeight):
                    staged.setdefault(pname.removesuffix(".weight"), {})[shard] = tensor
                else:
                    offset, size = self._shard_range(target, shard)
                    param.data[offset : offset + size].copy_(tensor)
                loaded.add(f"{pname}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"unexpected weight {name!r} in checkpoint")
            if isinstance(tensor, QuantizedWeight):
                staged.setdefault(name.removesuffix(".weight"), {})[0] = tensor
            else:
                params[name].data.copy_(tensor)
            loaded.add(name)
        expected = set()
        for pname in params:
            if pname.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                expected.update(f"{pname}#{i}" for i in range(3))
            elif pname.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                expected.update(f"{pname}#{i}" for i in range(2))
            elif not (pname == "lm_head.weight" and self.tie_word_embeddings):
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        return {path: [d[i] for i in sorted(d)] for path, d in staged.items()}

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        attn = self.layers[0].self_attn
        if target == "qkv_proj":
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
