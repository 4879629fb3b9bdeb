"""The CPU compiled forward's layer stack: one `decoder_stack` op call per forward
(`radixlm/kernels/cpu/decoder.cpp`) instead of ~15 Python-level calls per layer.

It runs exactly the ops of the Python layer with the `cpu` layer-op set and prepacked linears, in
the same order, so the two agree to the last bit (tested); it applies only where every piece is
the compiled one: the `cpu` attention backend reading the op's planned work items, `PackedLinear`
projections without a low-precision small-row copy or CPU `QuantLinear`s (weight-only int8 /
int4: the op calls the same torch kernels on the same packed tensors), no tensor parallelism.
Elsewhere the model runs its Python layers (`LlamaForCausalLM.forward`), which stay the reference.
"""

from __future__ import annotations

import logging

import torch

from radixlm.kernels.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def _stackable(m) -> bool:
    """A prepacked float linear without a small-row copy, or a CPU quantized one (no TP)."""
    from radixlm.runtime.models.cpu_linear import PackedLinear
    from radixlm.runtime.quantization import QuantLinear

    if type(m) is PackedLinear:
        return m.weight_lowp is None
    return type(m) is QuantLinear and m.qweight.device.type == "cpu" and m.group is None


def _weight(m) -> torch.Tensor:
    """The weight the op's oneDNN / low-bit path reads (radixlm's packed bf16 copy where there is
    no oneDNN copy: the op then never takes that path)."""
    if hasattr(m, "qweight"):
        return m.qweight
    return m.packed if m.packed is not None else m.weight_bf16


def _scales(m) -> torch.Tensor | None:  # None: the oneDNN-prepacked float linear
    return getattr(m, "scales", None)


class CpuDecoderStack:
    """Weights and KV buffers of every layer gathered once; `__call__(x, batch)` runs the stack
    on the embeddings `x` and returns `(x, residual)` as the Python layers would."""

    def __init__(self, model, attn) -> None:
        from radixlm.kernels.cpu.build import load_op

        self.op = load_op()
        layers = model.layers
        a0 = layers[0].self_attn
        self.attn = attn
        self.num_heads, self.num_kv_heads, self.head_dim = (
            a0.num_heads,
            a0.num_kv_heads,
            a0.head_dim,
        )
        proj = {
            "qkv": [lay.self_attn.qkv_proj for lay in layers],
            "o": [lay.self_attn.o_proj for lay in layers],
            "gate_up": [lay.mlp.gate_up_proj for lay in layers],
            "down": [lay.mlp.down_proj for lay in layers],
        }
        # Quantized linears take inputs of `dequant_min_rows` rows or more by a float copy made
        # for the call (`QuantLinear.forward`), which the op does not do: the Python layers do.
        limits = [
            m.kernel.dequant_min_rows - 1
            for v in proj.values()
            for m in v
            if _scales(m) is not None
        ]
        self.max_rows = min(limits) if limits else None
        w = {k: [_weight(m) for m in v] for k, v in proj.items()}
        s = {k: [_scales(m) for m in v] for k, v in proj.items()}
        b = {k: [m.bias for m in v] for k, v in proj.items()}
        # radixlm's packed bf16 weights, 4 per layer (qkv, o, gate_up, down), or none at all.
        packed = [getattr(m, "weight_bf16", None) for lay in zip(*proj.values()) for m in lay]
        self.packed = packed if all(t is not None for t in packed) else []
        # gate_up's width is the intermediate size: packed, it is packed gated (Llama's SiLU)
        out_features = [v[0].out_features for v in proj.values()]
        out_features[2] //= 2
        if self.packed and not all(m.gated for m in proj["gate_up"]):
            raise ValueError("decoder_stack: packed gate_up projections must be packed gated")
        # The op's per-model constants in one C++ object, built once and their only holder
        # here: a forward passes it instead of per-layer lists (see `DecoderWeights` in
        # decoder.cpp: no GIL taken while the op runs to drop references to these tensors).
        # NOTE: it holds the KV buffers and rotary tables of now; neither is ever replaced.
        self.held = torch.classes.radixlm_cpu.DecoderWeights(
            [lay.input_layernorm.weight.detach() for lay in layers],
            [lay.post_attention_layernorm.weight.detach() for lay in layers],
            w["qkv"], s["qkv"], b["qkv"], w["o"], s["o"], b["o"],
            w["gate_up"], s["gate_up"], b["gate_up"], w["down"], s["down"], b["down"],
            attn.kv_cache.k_buffers, attn.kv_cache.v_buffers, model.rotary.cos,
            model.rotary.sin, self.packed, out_features, layers[0].input_layernorm.eps,
            a0.scale, self.num_heads, self.num_kv_heads, self.head_dim, attn.kv_layout,
        )  # fmt: skip

    def takes(self, num_tokens: int) -> bool:
        """Whether the op runs a forward of `num_tokens` rows (else the Python layers do)."""
        return self.max_rows is None or num_tokens <= self.max_rows

    @staticmethod
    def unsupported_reason(model, attn) -> str | None:
        """Why the stack cannot run this model with this backend (None: it can)."""
        from radixlm.kernels.cpu.backend import CpuAttentionBackend
        from radixlm.kernels.cpu.build import load_op

        if not getattr(model, "CPU_STACK", False):
            return f"the compiled stack runs the Llama family only, not {type(model).__name__}"
        if load_op() is None:
            return "the CPU ops are unavailable"
        if not isinstance(attn, CpuAttentionBackend) or not attn.runs_compiled_op:
            return "the attention backend is not the compiled CPU op"
        if model.layer_ops.name != "cpu":
            return "the layer ops are not the fused CPU ops"
        for layer in model.layers:
            for m in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                if not _stackable(m):
                    return f"{type(m).__name__} projections (not prepacked or CPU quantized)"
        return None

    def __call__(
        self, x: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x [T, H] -> (x [T, H], residual [T, H])
        attn = self.attn
        part_o, part_lse = attn.partial_buffers(self.num_heads, self.head_dim)
        return self.op.decoder_stack(
            self.held,
            x,
            batch.positions,
            batch.out_cache_loc,
            attn.page_table,
            attn.plan.items,
            attn.plan.item_rows,
            attn.plan.reduces,
            part_o,
            part_lse,
            batch.page_size,
        )
