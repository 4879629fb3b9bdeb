"""Read a `.gguf` file tensor by tensor as Hugging Face names: float tensors as they are, the
mappable block types as `QuantizedWeight`s (their integers and scales, never a float copy).

Mapped: Q8_0 (int8, groups of 32), Q4_0 / Q4_1 (int4, groups of 32), Q4_K (int4, its 32-wide
sub-blocks with 6-bit scales and mins). Every other block type (Q5_*, Q6_K, IQ*, ...) is
dequantized by gguf's own `dequantize`, with one log line naming the tensor and its type.
llama.cpp stores the q/k rows of `llama` models permuted for its RoPE; they are permuted back
(transformers' `LlamaTensorProcessor` does the same to its dequantized copy).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from radixlm.runtime.quantization.weights import QuantizedWeight

logger = logging.getLogger(__name__)

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED_ARCHS = frozenset({"llama", "mistral"})
QK = 32  # the block (sub-block) width of every mapped type


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not a Llama-family weight, e.g. rope
    frequencies)."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _BLOCK_NAMES:
            return None
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[stem]}.{kind}" if stem in _TOP_NAMES else None


def _halves(raw: np.ndarray) -> torch.Tensor:  # [rows, blocks, 2] uint8 -> [rows, blocks] fp32
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [..., 16] -> [..., 32]: low nibbles first
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_blocks(type_name: str, raw: np.ndarray, rows: int, k: int) -> QuantizedWeight:
    """A mapped block type's `[rows, k]` weight from its raw bytes (`[rows, bytes per row]`)."""
    nb = k // QK
    if type_name == "Q8_0":  # d fp16, 32 x int8
        b = raw.reshape(rows, nb, 34)
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, k))
        return QuantizedWeight(8, q, _halves(b[..., :2]), None, QK, type_name)
    if type_name in ("Q4_0", "Q4_1"):  # d fp16, [m fp16], 16 bytes of nibbles
        head = 2 if type_name == "Q4_0" else 4
        b = raw.reshape(rows, nb, head + 16)
        q = torch.from_numpy(_nibbles(b[..., head:]).reshape(rows, k))
        d = _halves(b[..., :2])
        mins = -8 * d if type_name == "Q4_0" else _halves(b[..., 2:4])
        return QuantizedWeight(4, q, d, mins, QK, type_name)
    if type_name == "Q4_K":  # per 256: d, dmin fp16, 12 bytes of 6-bit scales/mins, 128 nibbles
        from gguf.quants import Q4_K

        ns = k // 256
        b = raw.reshape(rows * ns, 144)
        d = torch.from_numpy(b[:, :2].copy().view(np.float16).astype(np.float32))  # [B, 1]
        dmin = torch.from_numpy(b[:, 2:4].copy().view(np.float16).astype(np.float32))
        sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())  # [B, 8] each
        scales = d * torch.from_numpy(sc.astype(np.float32))
        mins = -(dmin * torch.from_numpy(mn.astype(np.float32)))
        shifts = np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qs = b[:, 16:].reshape(rows * ns, 4, 1, 32) >> shifts  # [B, 4, 2, 32]: sub-block 2c + h
        q = torch.from_numpy((qs & 0x0F).reshape(rows, k))
        return QuantizedWeight(4, q, scales.reshape(rows, nb), mins.reshape(rows, nb), QK, "Q4_K")
    raise ValueError(f"block type {type_name} is not mapped")


MAPPED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
FLOAT_TYPES = ("F32", "F16", "BF16")


def _row_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Indices undoing llama.cpp's q/k row permutation (`_reverse_permute_weights`)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def _permute_rows(w: torch.Tensor | QuantizedWeight, idx: torch.Tensor):
    if isinstance(w, torch.Tensor):
        return w[idx]
    mins = None if w.mins is None else w.mins[idx]
    return QuantizedWeight(w.bits, w.q[idx], w.scales[idx], mins, w.group_size, w.source)


def iter_gguf(
    path: Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield `(hf_name, tensor or QuantizedWeight)` for every Llama-family weight of `path`."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch_field = reader.get_field("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "llama"
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        type_name = t.tensor_type.name
        shape = [int(s) for s in reversed(t.shape.tolist())]  # ggml lists the fastest dim first
        if type_name in FLOAT_TYPES:
            w: torch.Tensor | QuantizedWeight = torch.from_numpy(
                np.asarray(t.data).astype(np.float32).reshape(shape)
            )
        elif type_name in MAPPED_TYPES and len(shape) == 2 and shape[1] % QK == 0:
            w = decode_blocks(type_name, np.asarray(t.data), shape[0], shape[1])
        else:
            logger.info(
                "gguf: tensor %s has type %s, which has no packed layout here: dequantized",
                t.name,
                type_name,
            )
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape).copy())
        if arch in _PERMUTED_ARCHS and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = num_heads if ".attn_q." in t.name else num_kv_heads
            w = _permute_rows(w, _row_permutation(shape[0], heads))
        yield name, w
