"""Weight-only quantized modules of the Llama-family model, and how a model gets them.

`QuantLinear` stands where an `nn.Linear` (or a row-parallel one) stood: same `in_features` /
`out_features` / `bias`, its weight packed for a `QuantKernel`; inputs of the kernel's
`dequant_min_rows` or more (prefill, large batches) multiply a float copy dequantized for the
call, fewer (decode) the low-bit kernel.
`QuantEmbedding` gathers rows of an int8 `QuantLinear`'s plain weight (the tied LM head and the
embedding share one copy).

Which linears get which format (`quantize_model`, `install_quantized`):
- the per-layer projections: int8 per output channel, or int4 in groups (`--quantization`);
- the embedding and the LM head: int8 per output channel in every mode (measured, see README:
  a batch-1 SmolLM2 LM head reads 57 MB in bf16 and 28 MB in int8, the step's largest single
  read; int4 is kept off the logits).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from radixlm.runtime.quantization.kernels import QuantKernel, get_kernel
from radixlm.runtime.quantization.weights import (
    QuantizedWeight,
    int4_group_for,
    quantize_int4,
    quantize_int8,
    requantize_per_channel_int8,
)

logger = logging.getLogger(__name__)

LAYER_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class QuantLinear(nn.Module):
    """`y = x @ dequantize(W)^T + b` by a weight-only low-bit kernel. With `group` (a row-parallel
    shard) the product is all-reduced before the bias is added, as `RowParallelLinear` does."""

    def __init__(
        self,
        qw: QuantizedWeight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        group: Any = None,
    ) -> None:
        super().__init__()
        if qw.bits == 8:
            qw = requantize_per_channel_int8(qw)
        self.kernel: QuantKernel = get_kernel(device.type, qw.bits)
        w, s = self.kernel.pack(qw, dtype, device)
        self.register_buffer("qweight", w)  # kernel layout
        self.register_buffer("scales", s)  # int8: [N]; int4: scales and zeros [K/g, N, 2]
        self.bias = None if bias is None else bias.detach().to(device=device, dtype=dtype)
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size, self.source = qw.bits, qw.group_size, qw.source
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        mm_dequantized = self.kernel.mm_dequantized
        if x.shape[0] >= self.kernel.dequant_min_rows and mm_dequantized is not None:
            y = mm_dequantized(x, self.qweight, self.scales)  # compute-bound: a float GEMM
        else:
            y = self.kernel.mm(x, self.qweight, self.scales)
        if self.group is not None:
            self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        g = "per channel" if self.bits == 8 else f"group {self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int{self.bits} {g} from {self.source}, {self.kernel.name}"
        )


class QuantEmbedding(nn.Module):
    """Rows of an int8 `QuantLinear`'s weight times their scales (the same storage)."""

    def __init__(self, head: QuantLinear) -> None:
        super().__init__()
        if head.bits != 8 or not head.kernel.plain_rows:
            raise ValueError("an embedding gathers rows of a plain int8 weight")
        self.qweight = head.qweight  # [V, H] int8
        self.scales = head.scales  # [V]
        self.embedding_dim = head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        s = self.scales[ids]
        return self.qweight[ids].to(s.dtype) * s[:, None]


def quantize_linear(
    linear: nn.Linear, mode: str, group_size: int, dtype: torch.dtype | None = None
) -> QuantLinear:
    """A `QuantLinear` of a float linear (`mode` "int8" or "int4"; int4 groups of `group_size`,
    or the largest offered size dividing K)."""
    w = linear.weight.detach()
    if mode == "int8":
        qw = quantize_int8(w)
    elif mode == "int4":
        qw = quantize_int4(w, int4_group_for(w.shape[1], group_size))
    else:
        raise ValueError(f"cannot quantize a linear to {mode!r}")
    return QuantLinear(
        qw, linear.bias, dtype or w.dtype, w.device, group=getattr(linear, "group", None)
    )


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _quantize_head_and_embedding(model: nn.Module, dtype: torch.dtype) -> None:
    head = quantize_linear(model.lm_head, "int8", 0, dtype)
    if model.tie_word_embeddings:
        model.embed_tokens = QuantEmbedding(head)
    else:
        emb = model.embed_tokens.weight.detach()
        model.embed_tokens = QuantEmbedding(
            QuantLinear(quantize_int8(emb), None, dtype, emb.device)
        )
    model.lm_head = head


def quantize_model(model: nn.Module, mode: str, group_size: int) -> int:
    """Replace the float projections of every layer by `mode` ("int8" / "int4") `QuantLinear`s,
    and the embedding and LM head by int8 ones; returns how many linears. NOTE: call after the
    weights are loaded and tied; a tensor-parallel shard is quantized as it is (shard, then
    quantize)."""
    count = 0
    for layer in model.layers:
        for path in LAYER_PROJECTIONS:
            lin = layer.get_submodule(path)
            if isinstance(lin, nn.Linear):
                _set(layer, path, quantize_linear(lin, mode, group_size))
                count += 1
    dtype = model.lm_head.weight.dtype
    _quantize_head_and_embedding(model, dtype)
    return count + 1


def install_quantized(
    model: nn.Module,
    quantized: dict[str, list[QuantizedWeight]],
    dtype: torch.dtype,
    device: torch.device,
) -> list[str]:
    """Put checkpoint-quantized weights (GGUF blocks) in place: `quantized[path]` lists the fused
    parts of module `path` in order ("embed_tokens", "lm_head" or a layer projection). Parts of
    different formats are dequantized into the float module (one log line). Returns the paths
    now quantized. The embedding and the LM head become int8 per output channel (requantized
    from group-wise scales, one log line); a tied LM head shares the embedding's copy."""
    done: list[str] = []
    requantized: list[str] = []
    for path, parts in quantized.items():
        if path == "embed_tokens" or path == "lm_head":
            continue
        module = model.get_submodule(path)
        try:
            qw = parts[0] if len(parts) == 1 else QuantizedWeight.cat_rows(parts)
        except ValueError:
            logger.info(
                "%s: parts of formats %s dequantized to %s", path, [p.source for p in parts], dtype
            )
            module.weight.data.copy_(torch.cat([p.dequantize() for p in parts]))
            continue
        if qw.bits == 8 and qw.group_size != qw.shape[1]:
            requantized.append(path)
        group = getattr(module, "group", None)
        _set(model, path, QuantLinear(qw, module.bias, dtype, device, group))
        done.append(path)
    if requantized:
        logger.info(
            "%d linears (%s, ...): int8 blocks requantized per output channel (the int8 "
            "kernel's layout)",
            len(requantized),
            requantized[0],
        )
    emb = quantized.get("embed_tokens")
    head = quantized.get("lm_head")
    if emb is not None or head is not None:
        for name, parts in (("embedding", emb), ("LM head", head)):
            if parts is not None and parts[0].group_size != parts[0].shape[1]:
                logger.info(
                    "%s: %s blocks of %d requantized to int8 per output channel (the int8 "
                    "kernel's layout)",
                    name,
                    parts[0].source,
                    parts[0].group_size,
                )
        if emb is not None and (head is not None or model.tie_word_embeddings):
            head_q = QuantLinear((head or emb)[0], None, dtype, device)
            model.lm_head = head_q
            model.embed_tokens = QuantEmbedding(
                head_q if head is None else QuantLinear(emb[0], None, dtype, device)
            )
            done += ["embed_tokens", "lm_head"]
        elif emb is not None:  # untied float head
            model.embed_tokens = QuantEmbedding(QuantLinear(emb[0], None, dtype, device))
            done.append("embed_tokens")
        else:
            model.lm_head = QuantLinear(head[0], None, dtype, device)  # type: ignore[index]
            done.append("lm_head")
    return done
