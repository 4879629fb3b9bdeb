"""Weight-only quantized modules of the Llama-family model, and how a model gets them.

`QuantLinear` stands where an `nn.Linear` (or a row-parallel one) stood: same `in_features` /
`out_features` / `bias`, its weight packed for a `QuantKernel`; inputs of the kernel's
`dequant_min_rows` or more (prefill, large batches) multiply a float copy dequantized for the
call, fewer (decode) the low-bit kernel.
`QuantEmbedding` gathers rows of an int8 `QuantLinear`'s plain weight (the tied LM head and the
embedding share one copy).

Which linears get which format (`quantize_model`, `install_quantized`):
- the per-layer projections: int8 per output channel, or int4 in groups (`--quantization`);
- the embedding: int8 per output channel; the LM head: int8 per output channel (default, one copy
  with a tied embedding), or int4 (`--quantization-lm-head int4`: faster at 1 row, a separate
  copy, less accurate). Figures in the README ("Quantized weights").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
        self.kernel: QuantKernel = get_kernel(device.type, qw.bits, dtype)
        w, s = self.kernel.pack(qw, dtype, device)
        self.register_buffer("qweight", w)  # kernel layout
        # int8: [N]; int4: torch's scales and zeros [K/g, N, 2] in `dtype`, or (radixlm's g32
        # kernel) fp16 scales and mins [N, K/32, 2]
        self.register_buffer("scales", s)
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

    def takes_masks(self, x: torch.Tensor) -> bool:
        """``masked_logits`` serves ``x`` (``[T, in]``): the kernel writes masked float32
        logits (``QuantKernel.mm_logits``) for this many rows, with nothing to add after it."""
        return (
            self.kernel.mm_logits is not None
            and x.shape[0] < self.kernel.dequant_min_rows
            and self.group is None
            and self.bias is None
        )

    def masked_logits(
        self, x: torch.Tensor, bitmask: torch.Tensor | None = None, rows: Sequence[int] = ()
    ) -> torch.Tensor:  # [T, in] -> [T, out] float32
        """``forward(x).float()`` with ``apply_token_bitmask(out, bitmask, rows)``'s masks (none
        without a bitmask), written as the kernel makes the logits (``takes_masks(x)`` must
        hold)."""
        mm_logits = self.kernel.mm_logits
        assert mm_logits is not None
        ids = torch.tensor(list(rows), dtype=torch.long)  # [R]
        return mm_logits(x, self.qweight, self.scales, bitmask, ids)

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


def _int8_weight(w: torch.Tensor | QuantizedWeight) -> QuantizedWeight:
    if isinstance(w, torch.Tensor):
        return quantize_int8(w)
    return requantize_per_channel_int8(w)


def _head_weight(w: torch.Tensor | QuantizedWeight, head: str, group: int) -> QuantizedWeight:
    """The LM head's weight: int8 per output channel, or (`head` "int4") int4 groups."""
    if head == "int8":
        return _int8_weight(w)
    k = w.shape[1]
    g = int4_group_for(k, group)
    if isinstance(w, QuantizedWeight):
        if w.bits == 4 and w.group_size == g:
            return w
        w = w.dequantize()
    return quantize_int4(w, g)


def install_head_and_embedding(
    model: nn.Module,
    head_w: torch.Tensor | QuantizedWeight | None,
    emb_w: torch.Tensor | QuantizedWeight | None,
    head: str,
    group: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Quantize the LM head (`head`: "int8" or "int4") and the embedding (int8 per output
    channel: `QuantEmbedding` gathers rows of a plain int8 weight). `head_w` None on a tied
    model: the head is the embedding's weight; with an int8 head the two share one copy. A None
    weight (and no tie) leaves that module as it is."""
    if head_w is None and model.tie_word_embeddings:
        head_w = emb_w
    if head_w is not None:
        model.lm_head = QuantLinear(_head_weight(head_w, head, group), None, dtype, device)
    if emb_w is None:
        return
    if model.tie_word_embeddings and head == "int8" and head_w is emb_w:
        model.embed_tokens = QuantEmbedding(model.lm_head)
    else:
        model.embed_tokens = QuantEmbedding(QuantLinear(_int8_weight(emb_w), None, dtype, device))


def _submodule_or_none(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def quantize_model(model: nn.Module, mode: str, group_size: int, head: str = "int8") -> int:
    """Replace the float projections of every layer by `mode` ("int8" / "int4") `QuantLinear`s,
    the LM head by a `head` one and the embedding by an int8 one; returns how many linears.
    NOTE: call after the weights are loaded and tied; a tensor-parallel shard is quantized as
    it is (shard, then quantize). A sparse MoE layer has no `mlp.gate_up_proj`: its experts
    stay dense."""
    count = 0
    for layer in model.layers:
        for path in LAYER_PROJECTIONS:
            lin = _submodule_or_none(layer, path)
            if isinstance(lin, nn.Linear):
                _set(layer, path, quantize_linear(lin, mode, group_size))
                count += 1
    w = model.lm_head.weight
    emb = model.embed_tokens.weight.detach()
    head_w = None if model.tie_word_embeddings else w.detach()
    install_head_and_embedding(model, head_w, emb, head, group_size, w.dtype, w.device)
    return count + 1


def install_quantized(
    model: nn.Module,
    quantized: dict[str, list[QuantizedWeight]],
    dtype: torch.dtype,
    device: torch.device,
    head: str = "int8",
    group_size: int = 32,
) -> list[str]:
    """Put checkpoint-quantized weights (GGUF blocks) in place: `quantized[path]` lists the fused
    parts of module `path` in order ("embed_tokens", "lm_head" or a layer projection). Parts of
    different formats are dequantized into the float module (one log line). Returns the paths
    now quantized. The embedding and the LM head: `install_head_and_embedding` (one log line
    each)."""
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
    head_parts = quantized.get("lm_head")
    if emb is not None:
        logger.info("embedding: %s blocks -> int8 per output channel", emb[0].source)
    if head_parts is not None or (emb is not None and model.tie_word_embeddings):
        logger.info(
            "LM head%s: %s blocks -> %s",
            "" if head_parts else " (tied)",
            (head_parts or emb)[0].source,  # type: ignore[index]
            "int8 per output channel" if head == "int8" else f"int4 in groups of {group_size}",
        )
    if emb is not None or head_parts is not None:
        head_w = None if head_parts is None else head_parts[0]
        emb_w = None if emb is None else emb[0]
        install_head_and_embedding(model, head_w, emb_w, head, group_size, dtype, device)
        done += [p for p, parts in (("embed_tokens", emb), ("lm_head", head_parts)) if parts]
    return done
