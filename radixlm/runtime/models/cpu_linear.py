"""Matmul dtype on CPUs without native bf16 (no AVX512_BF16 / AMX).

There, oneDNN runs a bf16 GEMM by converting to fp32 on the fly: at 8+ rows it is 2-7x slower than
an fp32 GEMM of the same shape (measured on an AVX2 EPYC: 64 x 576 x 3072, 16.5 ms vs 2.9 ms),
while a 1-2 row product (a GEMV, memory-bound) is faster in bf16 (it reads half the bytes).
`matmul_dtype="auto"` therefore computes in fp32: with the compiled forward, on the bf16 weights
through radixlm's packed kernel (every row count on an AVX2 CPU; fp32 activations, each weight
pair widened exactly: `PackedLinear`); eager, on fp32 weights with a bf16 copy for the few-row
case (`SmallRowsLowpLinear`). The KV cache keeps the model's dtype (bf16: half the attention
traffic).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels.host_memory import zeros_huge

logger = logging.getLogger(__name__)

# At most this many rows run the low-precision copy (measured crossover: 2-4 rows).
SMALL_ROWS = 2
# Where radixlm's bf16 kernel runs only up to a row count (AMX CPUs: oneDNN above it), both the
# packed copy and oneDNN's are kept, the former only where the layer weights total at most this
# (it doubles their memory). Without AMX the packed copy is the only one.
DUAL_MAX_WEIGHT_BYTES = 1 << 30
MATMUL_DTYPES = ("auto", "model", "float32")


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    """The CPU's instruction-set flags (None: unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return None


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16)."""
    flags = _cpu_flags()
    if flags is None:
        return True  # unknown: keep the model dtype
    return "avx512_bf16" in flags or "amx_bf16" in flags


def compute_dtype(model_dtype: torch.dtype, device: torch.device, policy: str) -> torch.dtype:
    """The dtype the model's weights and activations compute in (`policy` in MATMUL_DTYPES)."""
    if policy not in MATMUL_DTYPES:
        raise ValueError(f"matmul_dtype must be one of {MATMUL_DTYPES}, got {policy!r}")
    if policy == "model" or model_dtype == torch.float32 or device.type != "cpu":
        return model_dtype
    if policy == "float32" or not cpu_has_native_bf16():
        return torch.float32
    return model_dtype


class SmallRowsLowpLinear(nn.Linear):
    """An fp32 `nn.Linear` that multiplies inputs of at most `SMALL_ROWS` rows with a
    low-precision copy of its weight (and returns fp32)."""

    weight_lowp: torch.Tensor
    bias_lowp: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if x.shape[0] <= SMALL_ROWS:
            return F.linear(x.to(self.weight_lowp.dtype), self.weight_lowp, self.bias_lowp).to(
                x.dtype
            )
        return F.linear(x, self.weight, self.bias)


def add_lowp_copies(model: nn.Module, lowp: torch.dtype) -> int:
    """Give every `nn.Linear` of `model` a `lowp` weight copy for small-row inputs; returns how
    many. NOTE: call after the weights are loaded (the copies are not kept in sync)."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = SmallRowsLowpLinear
            module.weight_lowp = module.weight.detach().to(lowp)
            module.bias_lowp = None if module.bias is None else module.bias.detach().to(lowp)
            count += 1
    return count


# The row count oneDNN's weight layout is chosen for; measured on an AVX512_BF16 EPYC (2
# threads, 30 layers of SmolLM2's 576 x 3072): a layout packed for 64 rows runs 1-512 rows
# within 3% of the layout packed for each count, while 512 costs 12% at 1 row.
PACK_ROWS_HINT = 64


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


def onednn_packs_bf16() -> bool:
    """Whether oneDNN reorders (prepacks) bf16 weights here: it needs AVX512 BW / VL / DQ or
    AVX-NE-CONVERT (an AVX2-only CPU has neither: bf16 weights stay unpacked there)."""
    flags = _cpu_flags()
    if flags is None:
        return True
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


class PackedLinear(nn.Module):
    """`y = x @ W^T + b` on a weight reordered once (what Inductor's freezing does), the CPU
    compiled forward's linear: bf16 weights on AVX512_BF16 CPUs through radixlm's packed kernel
    (`kernels/cpu/linear_bf16.cpp`, `bf16_kernel=True`), for inputs of at most
    `linear_bf16_max_rows()` rows (every count without AMX); the rest through oneDNN on its own
    blocked layout (`mkldnn::_linear_pointwise`). Measured (bf16, 2 threads, weights streamed from
    memory, SmolLM2's 120 layer linears): oneDNN 10.6 vs `F.linear` 15.0 ms at 1 row; radixlm's
    kernel faster than oneDNN at every row count measured, 1 to 512 (README).

    `gated` (a SiLU MLP's `gate_up_proj`, with the bf16 kernel): the module returns
    `silu(gate) * up` [T, I], SiLU-and-mul fused into the kernel's epilogue (oneDNN rows: the
    fused CPU op after it), with the numerics of the two ops in sequence.

    With `lowp` bf16 (CPUs without native bf16 computing in fp32), inputs of up to
    `linear_bf16_fp32_max_rows()` rows run the packed kernel's fp32-activation path on a bf16
    copy of the weight (AVX2 + FMA: half the bytes an fp32 GEMV streams, and as fast as oneDNN's
    fp32 GEMM at prefill sizes): every row count without AVX-512, and then no oneDNN copy is
    kept; with AVX-512F the few-row passes, oneDNN's fp32 GEMM above. Where that path is not
    built, oneDNN's fp32 GEMM, with inputs of at most `SMALL_ROWS` rows multiplying a
    low-precision copy instead, as `SmallRowsLowpLinear` does.
    NOTE: holds no `weight` parameter: the packed copies replace it (the tied embedding keeps
    its own)."""

    def __init__(
        self,
        linear: nn.Linear,
        lowp: torch.dtype | None = None,
        bf16_kernel: bool = False,
        gated: bool = False,
    ) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # The packed kernel's inputs: bf16 (AVX512_BF16, a bf16 weight), or fp32 activations on a
        # bf16 copy of an fp32 weight where the CPU computes in fp32 (`lowp` bf16, AVX2)
        fp32_kernel = (
            lowp == torch.bfloat16 and w.dtype == torch.float32 and linear_bf16_fp32_max_rows() > 0
        )
        bf16_kernel = (bf16_kernel and w.dtype == torch.bfloat16) or fp32_kernel
        self.kernel_dtype = w.dtype if bf16_kernel else None
        self.gated = gated and bf16_kernel
        # radixlm's packed bf16 copy ([ceil(N / 32), ceil(K / 2), 64]; gated
        # [ceil(N / 2 / 16), ...]), or None
        self.weight_bf16 = (
            _op().pack_bf16_linear(w.to(torch.bfloat16), self.gated) if bf16_kernel else None
        )
        self.bf16_max_rows = -1
        if self.weight_bf16 is not None:
            self.bf16_max_rows = (
                linear_bf16_fp32_max_rows() if fp32_kernel else linear_bf16_max_rows()
            )
        # oneDNN's copy: only for the rows the packed kernel does not take
        self.packed = (
            torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
            if self.bf16_max_rows < sys.maxsize
            else None
        )
        lowp = None if fp32_kernel else lowp  # the packed copy serves the few-row inputs
        self.weight_lowp = None if lowp is None else w.to(lowp)
        self.bias_lowp = None if lowp is None or self.bias is None else self.bias.to(lowp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out] ([T, out / 2] gated)
        if x.shape[0] <= self.bf16_max_rows and x.dtype == self.kernel_dtype:
            n = self.out_features // 2 if self.gated else self.out_features
            return _op().linear_bf16(x, self.weight_bf16, self.bias, n, self.gated)
        if self.gated:
            return _op().silu_and_mul(
                torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            )
        if self.weight_lowp is not None and x.shape[0] <= SMALL_ROWS:
            return F.linear(x.to(self.weight_lowp.dtype), self.weight_lowp, self.bias_lowp).to(
                x.dtype
            )
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def takes_masks(self, x: torch.Tensor) -> bool:
        """``masked_logits`` serves ``x`` (``[T, in]``): rows the packed kernel takes (bf16 on
        AVX512_BF16; fp32 activations on the fp32 path, whose output is float32 anyway)."""
        return (
            not self.gated
            and self.kernel_dtype is not None
            and x.dtype == self.kernel_dtype
            and x.shape[0] <= self.bf16_max_rows
        )

    def masked_logits(
        self, x: torch.Tensor, bitmask: torch.Tensor | None = None, rows: Sequence[int] = ()
    ) -> torch.Tensor:  # [T, in] -> [T, out] float32
        """``forward(x).float()`` with ``apply_token_bitmask(out, bitmask, rows)``'s masks (none
        without a bitmask), written as the kernel makes the logits (``takes_masks(x)`` must
        hold): the LM head's float32 logits, with a grammar's masks, and no pass over them
        afterwards."""
        ids = torch.tensor(list(rows), dtype=torch.long)  # [R]
        return _op().linear_bf16_logits(
            x, self.weight_bf16, self.bias, self.out_features, bitmask, ids
        )

    def extra_repr(self) -> str:
        kind = "onednn" if self.weight_bf16 is None else "bf16 packed"
        if self.gated:
            kind += ", silu-and-mul fused"
        if self.weight_bf16 is not None and self.packed is not None:
            kind += f" (<= {self.bf16_max_rows} rows), onednn"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


@functools.cache
def _op():
    from radixlm.kernels.cpu.build import load_op

    return load_op()


@functools.cache
def linear_bf16_max_rows() -> int:
    """Inputs of at most this many rows take radixlm's bf16 kernel (`linear_bf16.cpp`): every
    count (`sys.maxsize`) on CPUs without AMX."""
    op = _op()
    return min(int(op.linear_bf16_max_rows()), sys.maxsize) if op is not None else 0


@functools.cache
def linear_bf16_fp32_max_rows() -> int:
    """fp32 inputs of at most this many rows take radixlm's packed kernel on a bf16 weight copy
    (`linear_bf16.cpp`, AVX2 + FMA): every count (`sys.maxsize`) without AVX-512, the few-row
    passes' 32 with AVX-512F (oneDNN's fp32 GEMM has 16-lane FMAs there); 0 where it is not
    built."""
    op = _op()
    return min(int(op.linear_bf16_fp32_max_rows()), sys.maxsize) if op is not None else 0


def bf16_kernel_supported() -> bool:
    """Whether radixlm's bf16 linear runs here (the op built, AVX512_BF16)."""
    op = _op()
    return op is not None and bool(op.has_bf16_dot())


def pack_linears(
    model: nn.Module, lowp: torch.dtype | None = None, bf16_kernel: bool = False
) -> int:
    """Replace every plain `nn.Linear` of `model` (fp32 weights; bf16 where oneDNN packs them or
    radixlm's bf16 kernel takes every row count) by a `PackedLinear`; returns how many.
    Tensor-parallel linears (subclasses) keep their own forward. With
    `bf16_kernel` (radixlm's bf16 linear runs here: `bf16_kernel_supported()`), bf16 linears are
    packed for it; where it takes only a few rows (AMX), only when their weights total at most
    `DUAL_MAX_WEIGHT_BYTES` (both copies are kept). A SiLU MLP's `gate_up_proj` (a parent with
    `act == "silu"`) is packed gated (the module then returns silu(gate) * up; the MLP sees
    `gated`). NOTE: call after the weights are loaded and tied."""
    keep = bf16_kernel and lowp is None
    # bf16 weights are packed only where oneDNN can reorder them or the bf16 kernel takes every row
    dtypes = (torch.float32,)
    if onednn_packs_bf16() or (keep and linear_bf16_max_rows() >= sys.maxsize):
        dtypes += (torch.bfloat16,)
    found = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if type(child) is nn.Linear and child.weight.dtype in dtypes
    ]
    if keep and linear_bf16_max_rows() < sys.maxsize:
        keep = sum(c.weight.numel() * c.weight.element_size() for _, _, c in found) <= (
            DUAL_MAX_WEIGHT_BYTES
        )
    packed = []
    for parent, name, child in found:
        gated = name == "gate_up_proj" and getattr(parent, "act", None) == "silu"
        packed.append(PackedLinear(child, lowp, bf16_kernel=keep, gated=gated))
        setattr(parent, name, packed[-1])
    return len(found)


# The attributes of the CPU linears that hold the weights a forward streams: `PackedLinear`'s
# packed bf16 copy; `QuantLinear`'s (and a tied `QuantEmbedding`'s) low-bit weight and scales.
STREAMED_WEIGHTS = ("weight_bf16", "qweight", "scales")


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Move the CPU linears' streamed weights (`STREAMED_WEIGHTS`) into one allocation per dtype
    advised for transparent huge pages (`host_memory.zeros_huge`), in module order (a forward
    streams them in that order); a tensor two modules share (a tied quantized head and
    embedding) moves once and both then hold the moved copy. Returns the bytes moved.
    NOTE: call before anything keeps references to the weights (`CpuDecoderStack`)."""
    slots: list[tuple[nn.Module, str, torch.Tensor]] = []
    for m in model.modules():
        for name in STREAMED_WEIGHTS:
            t = getattr(m, name, None)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous():
                slots.append((m, name, t))

    def key(t: torch.Tensor) -> tuple[int, int, torch.dtype]:
        return t.data_ptr(), t.numel(), t.dtype

    unique: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
    for _, _, t in slots:
        unique.setdefault(key(t), t)
    moved: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
    for dtype in dict.fromkeys(t.dtype for t in unique.values()):
        group = [(k, t) for k, t in unique.items() if t.dtype == dtype]
        arena = zeros_huge((sum(t.numel() for _, t in group),), dtype)
        offset = 0
        for k, t in group:
            view = arena[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            moved[k] = view
            offset += t.numel()
    for m, name, t in slots:
        setattr(m, name, moved[key(t)])
    return sum(t.numel() * t.element_size() for t in unique.values())
