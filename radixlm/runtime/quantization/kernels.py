"""Weight-only low-bit matmul kernels by (device type, bits): how a `QuantizedWeight` is packed into
a kernel's layout, and the call that multiplies by it. torch's own ops and radixlm's compiled
int4 kernel (no extra dependency):

- CPU int8: one scale per output row on the plain `q [N, K]` int8 rows; on bf16 with AVX512_BF16
  radixlm's `int8_mm` (`kernels/cpu/int8_gemm.cpp`, `INT8_ROWS`), elsewhere
  `aten._weight_int8pack_mm(x, q, scales [N])`.
- CPU int4 on bf16 with AVX512_BF16: radixlm's `int4_g32_mm` (`kernels/cpu/int4_gemm.cpp`) on
  `pack_int4_g32`'s layout (groups of 32, fp16 scale and min), every row count (`INT4_G32`).
- CPU int4 elsewhere: `aten._weight_int4pack_mm_for_cpu(x, packed, group,
  scales_and_zeros [K/g, N, 2])` on `aten._convert_weight_to_int4pack_for_cpu(q [N, K] int32)`;
  it computes `w = (q - 8) * scale + zero`, so `zero = min + 8 * scale` (our `w = q * scale + min`).
- CUDA int4: `aten._weight_int4pack_mm` on `aten._convert_weight_to_int4pack` (tinygemm, bf16),
  same zero convention. CUDA int8: `F.linear` on the int8 weight cast to the activation dtype,
  times the row scales (torch has no CUDA weight-only int8 GEMM).

The C++ layer stack (`radixlm/kernels/cpu/decoder.cpp`) calls the same CPU ops on the same
packed tensors, telling them apart by the weight's dtype (int8 / uint8) and, for uint8, the
scales' (fp16: radixlm's int4 layout).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.runtime.quantization.weights import QuantizedWeight


@dataclass(frozen=True)
class QuantKernel:
    """`pack(qw, dtype, device) -> (weight, scales)`; `mm(x [T, K], weight, scales) -> [T, N]`;
    `dequantize(weight, scales) -> [N, K]` in the scales' dtype (the reference) and
    `mm_dequantized(x, weight, scales) -> [T, N]`, the product through a float copy made for the
    call (None: not offered)."""

    name: str
    pack: Callable[[QuantizedWeight, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]]
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    dequantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    mm_dequantized: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Inputs of at least this many rows take `mm_dequantized`: the low-bit CPU kernels are
    # compute-bound past a few rows (crossovers measured on SmolLM2's 120 linears, README).
    dequant_min_rows: int = 1 << 62
    # The packed int8 weight is the plain [N, K] matrix (an embedding can gather its rows).
    plain_rows: bool = False
    # `mm(...).float()` with grammar masks in it: `(x, weight, scales, bitmask [>= T, W] int32
    # or None, rows [R] int64) -> [T, N] float32`, -inf where bit n of bitmask[r] is 0 for each r in
    # rows (the LM head's logits, written masked: `QuantLinear.masked_logits`). None: not offered.
    mm_logits: (
        Callable[
            [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
        ]
        | None
    ) = None


def _pack_int8(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    if qw.bits != 8 or qw.group_size != qw.shape[1]:
        raise ValueError("the int8 kernels take one scale per output row")
    return qw.q.contiguous().to(device), qw.scales[:, 0].to(device=device, dtype=dtype)


def _scales_and_zeros(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:  # [K/g, N, 2]
    if qw.bits != 4:
        raise ValueError("the int4 kernels take 4-bit weights")
    zeros = qw.mins + 8 * qw.scales  # type: ignore[operator]
    return torch.stack([qw.scales, zeros], dim=-1).transpose(0, 1).to(dtype).contiguous()


@dataclass(frozen=True)
class Int4CpuLayout:
    """Where `_convert_weight_to_int4pack_for_cpu` puts the nibbles of an N-row weight: runs of
    `count` blocks of `size` rows, each block stored k-major, its rows in `order` along a k
    (AVX-512: blocks of 64 rows ordered 0, 32, 1, 33, ..., 16, 48, ...; a tail block in row
    order). Learned by packing probes, not assumed: `int4_cpu_layout`."""

    groups: tuple[tuple[int, int, torch.Tensor], ...]  # (count, size, order [size])


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # [...] uint8 -> [... * 2]: low first
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(-1)


@functools.cache
def int4_cpu_layout(n: int) -> Int4CpuLayout:
    """The layout of an N-row packed weight, from three probe packs of an [N, 2] weight (the
    k index, and the row index's two low hex digits) read back nibble by nibble."""
    rows = torch.arange(n)[:, None].expand(n, 2)
    ks = torch.arange(2)[None, :].expand(n, 2)

    def probe(q: torch.Tensor) -> torch.Tensor:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        return _nibbles(packed).long()

    _, runs = torch.unique_consecutive(probe(ks), return_counts=True)  # k = 0, 1, 0, 1, ...
    low = probe(rows % 16) + 16 * probe(rows // 16 % 16)  # row index mod 256
    groups: list[tuple[int, int, torch.Tensor]] = []
    pos = 0
    for size in runs[::2].tolist():  # each block: its k = 0 run, then its k = 1 run
        # nibble j of the block -> its row, relative to the block's first row
        order = (low[pos : pos + size] - low[pos : pos + size].min()) % 256
        if groups and groups[-1][1] == size and torch.equal(groups[-1][2], order):
            groups[-1] = (groups[-1][0] + 1, size, order)
        else:
            groups.append((1, size, order))
        pos += 2 * size
    return Int4CpuLayout(tuple(groups))


def unpack_int4_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:  # -> [N, K] uint8
    """The [N, K] nibbles `_convert_weight_to_int4pack_for_cpu` packed into `packed`."""
    nib = _nibbles(packed)
    out, off = [], 0
    for count, size, order in int4_cpu_layout(n).groups:
        seg = nib[off : off + count * k * size].view(count, k, size)[:, :, torch.argsort(order)]
        out.append(seg.transpose(1, 2).reshape(count * size, k))
        off += count * k * size
    return out[0] if len(out) == 1 else torch.cat(out)


INT4_PAIRED, INT4_SPLIT = 0, 1  # `int4_dequantize_t`'s two block layouts


@functools.cache
def int4_cpu_blocks(n: int) -> torch.Tensor | None:
    """`[NB, 2]`: each block's rows and byte layout, as `int4_dequantize_t` reads an N-row pack
    (paired: byte i holds rows 2i, 2i + 1; split: rows i, i + size/2); None when a block has
    neither layout (the twin then dequantizes)."""
    blocks = []
    for count, size, order in int4_cpu_layout(n).groups:
        half = torch.arange(size // 2)
        paired = torch.stack([2 * half, 2 * half + 1], dim=1).reshape(-1)
        split = torch.stack([half, half + size // 2], dim=1).reshape(-1)
        if torch.equal(order, paired):
            blocks += [(size, INT4_PAIRED)] * count
        elif torch.equal(order, split):
            blocks += [(size, INT4_SPLIT)] * count
        else:
            return None
    return torch.tensor(blocks, dtype=torch.int64)


def _pack_int4_cpu(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    q = qw.q.to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    _check_unpack(*qw.shape)
    return packed, _scales_and_zeros(qw, dtype)


@functools.cache
def _check_unpack(n: int, k: int) -> None:
    """Once per shape: a probe weight unpacks to itself (the learned layout holds at this K)."""
    probe = (torch.arange(n * k) * 7 % 16).reshape(n, k).to(torch.int32)
    again = unpack_int4_cpu(torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1), n, k)
    if not torch.equal(again.to(torch.int32), probe):
        raise RuntimeError(f"the int4 CPU pack layout of a {n} x {k} weight is not the learned one")


def _dequantize_int4_cpu(w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:  # -> [N, K]
    groups, n = sz.shape[0], sz.shape[1]
    k = w.shape[1] * 2
    q = unpack_int4_cpu(w, n, k).view(n, groups, k // groups).to(sz.dtype)
    s = sz[..., 0].t().contiguous()[..., None]  # [N, G, 1]
    z = sz[..., 1].t().contiguous()[..., None]
    return torch.addcmul(z - 8 * s, q, s).view(n, k)  # (q - 8) * s + z


def _dequantize_int8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # -> [N, K]
    return w.to(s.dtype) * s[:, None]


# The float copy is made and multiplied this many weight elements at a time (4 MB of bf16): a
# 49152 x 576 LM head dequantized whole is a fresh 57 MB allocation per call, whose page faults
# cost more than the dequantization (measured: 68 vs 20 ms).
DEQUANT_CHUNK_ELEMS = 1 << 21


def _row_chunks(n: int, k: int, align: int) -> list[tuple[int, int]]:
    step = max(align, DEQUANT_CHUNK_ELEMS // k // align * align)
    return [(n0, min(n, n0 + step)) for n0 in range(0, n, step)]


def _mm_dequantized_int8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    parts = [F.linear(x, _dequantize_int8(w[n0:n1], s[n0:n1])) for n0, n1 in _row_chunks(n, k, 64)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _mm_dequantized_int4_cpu(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """`x @ dequantize(w)^T` by a float GEMM on the transposed weight the compiled op writes
    (`int4_dequantize_t`, reading the pack in order), a run of whole blocks at a time; without
    the op, the twin."""
    from radixlm.kernels.cpu.build import load_op

    op = load_op()
    n, k = sz.shape[1], x.shape[1]
    blocks = int4_cpu_blocks(n)
    if op is None or blocks is None:
        return F.linear(x, _dequantize_int4_cpu(w, sz))
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), blocks[:, 0].cumsum(0)]).tolist()
    parts = []
    for n0, n1 in _row_chunks(n, k, int(blocks[0, 0])):
        b0, b1 = starts.index(n0), starts.index(n1)  # chunks end on block boundaries
        part_sz = sz[:, n0:n1].contiguous()
        parts.append(x @ op.int4_dequantize_t(w[n0:n1], blocks[b0:b1], part_sz, k))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _mm_int8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, w, s)


def _mm_int4_cpu(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, x.shape[-1] // sz.shape[0], sz)


# radixlm's own CPU int4 kernel (`kernels/cpu/int4_gemm.cpp`, AVX512_BF16): groups of 32 inputs,
# fp16 scale and min each (Q4_1's storage), output rows in blocks of 16.
G32, G32_BLOCK = 32, 16


def _g32_scales_mins(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:  # [N, K/32] x2
    """The weight's scales and mins per 32 inputs (a coarser group repeats its own), in fp16."""
    if qw.bits != 4 or qw.group_size % G32:
        raise ValueError(
            f"the int4 g32 kernel takes 4-bit groups of a multiple of 32, got "
            f"int{qw.bits} groups of {qw.group_size}"
        )
    rep = qw.group_size // G32
    s, m = (t.repeat_interleave(rep, dim=1) for t in (qw.scales, qw.mins))  # type: ignore[union-attr]
    fmax = torch.finfo(torch.float16).max
    for name, t in (("scales", s), ("mins", m)):
        if not bool(t.abs().le(fmax).all()):
            raise ValueError(f"int4 {name} of {qw.source} exceed float16's range (the g32 kernel)")
    return s.half(), m.half()


def _g32_blocks(n: int) -> list[tuple[int, int]]:
    return [(n0, min(n, n0 + G32_BLOCK)) for n0 in range(0, n, G32_BLOCK)]


def pack_int4_g32(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """`(w uint8 [N, K/2], scales_mins fp16 [N, K/32, 2])` in `int4_gemm.cpp`'s layout: per block
    of 16 rows (tail: nr), per group, 4 chunks of 8 inputs in which 16-bit word j holds
    q[row j // 2, 8 chunk + 2 c + j % 2] in nibble c; a block's scales then mins per group."""
    n, k = qw.shape
    s, m = _g32_scales_mins(qw)
    w_parts, sm_parts = [], []
    for n0, n1 in _g32_blocks(n):
        nr, g = n1 - n0, k // G32
        q = qw.q[n0:n1].view(nr, g, 4, 4, 2)  # [row, group, chunk, nibble c, parity]
        q = q.permute(1, 2, 0, 4, 3).reshape(-1, 2, 2)  # [..., byte of the word, nibble pair]
        w_parts.append((q[..., 0] | q[..., 1] << 4).reshape(-1))  # low nibble first
        sm_parts.append(torch.stack([s[n0:n1].t(), m[n0:n1].t()], dim=1).reshape(-1))
    w = torch.cat(w_parts).view(n, k // 2)
    return w.contiguous(), torch.cat(sm_parts).view(n, k // G32, 2).contiguous()


def dequantize_int4_g32(w: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:  # -> [N, K] fp32
    """The twin of `int4_g32_dequantize`: `s * q + m` from `pack_int4_g32`'s layout."""
    n, k = w.shape[0], w.shape[1] * 2
    g = k // G32
    flat, sflat = w.reshape(-1), sm.reshape(-1)
    out = []
    for n0, n1 in _g32_blocks(n):
        nr = n1 - n0
        b = flat[n0 * k // 2 : n1 * k // 2].view(g, 4, nr, 2, 2)  # [group, chunk, row, par, byte]
        q = torch.stack([b & 15, b >> 4], dim=-1).view(g, 4, nr, 2, 4)  # nibble c = 2 byte + hi
        q = q.permute(2, 0, 1, 4, 3).reshape(nr, k).float()  # [row, group, chunk, c, parity]
        sm_b = sflat[n0 * g * 2 : n1 * g * 2].view(g, 2, nr).float()
        s, m = sm_b[:, 0].t(), sm_b[:, 1].t()  # [nr, G]
        out.append(q * s.repeat_interleave(G32, 1) + m.repeat_interleave(G32, 1))
    return torch.cat(out)


def _pack_int4_g32(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    if dtype != torch.bfloat16 or device.type != "cpu":
        raise ValueError("the int4 g32 kernel takes bf16 activations on CPU")
    return pack_int4_g32(qw)


def _mm_int4_g32(x: torch.Tensor, w: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    return _g32_op().int4_g32_mm(x, w, sm)


@functools.cache
def _g32_op():
    from radixlm.kernels.cpu.build import load_op

    return load_op()


@functools.cache
def _bf16_dot() -> bool:
    op = _g32_op()
    return op is not None and bool(op.has_bf16_dot())


def int4_g32_supported() -> bool:
    """Whether radixlm's int4 kernel runs here (the op built with AVX512_BF16)."""
    return _bf16_dot()


def int8_rows_supported() -> bool:
    """Whether radixlm's int8 kernel runs here (the op built with AVX512_BF16)."""
    return _bf16_dot()


def _mm_int8_rows(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return _g32_op().int8_mm(x, w, s)


def _mm_int8_logits(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    return _g32_op().int8_mm_logits(x, w, s, bitmask, rows)


# From this many rows `INT8_ROWS` multiplies a float copy instead (measured crossover, README).
INT8_ROWS_DEQUANT_MIN_ROWS = 48

# tinygemm packs K in tiles of 16, `inner_k_tiles` (8, 4 or 2) of them per packed group; the
# product reads the count back from the packed shape.
CUDA_INNER_K_TILES = (8, 4, 2)


def cuda_inner_k_tiles(k: int) -> int:
    """The most tiles per packed group that divide K (SmolLM2's K = 576 takes 4, not 8)."""
    for tiles in CUDA_INNER_K_TILES:
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"CUDA int4 (tinygemm) needs K divisible by 32, got K = {k}")


def _pack_int4_cuda(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device):
    q = qw.q.to(device)
    nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K/2]
    tiles = cuda_inner_k_tiles(q.shape[1])
    packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, tiles)
    # NOTE: tinygemm multiplies bf16 only: its scales are bf16 whatever the model's dtype
    return packed, _scales_and_zeros(qw, torch.bfloat16).to(device)


def _mm_int4_cuda(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """tinygemm in bf16; a float32 model's activations are cast there and back."""
    y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), w, x.shape[-1] // sz.shape[0], sz)
    return y.to(x.dtype)


def _mm_int8_cuda(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype)) * s


KERNELS: dict[tuple[str, int], QuantKernel] = {
    ("cpu", 8): QuantKernel(
        "aten._weight_int8pack_mm",
        _pack_int8,
        _mm_int8,
        _dequantize_int8,
        _mm_dequantized_int8,
        dequant_min_rows=16,
        plain_rows=True,
    ),
    ("cpu", 4): QuantKernel(
        "aten._weight_int4pack_mm_for_cpu",
        _pack_int4_cpu,
        _mm_int4_cpu,
        _dequantize_int4_cpu,
        _mm_dequantized_int4_cpu,
        dequant_min_rows=32,
    ),
    ("cuda", 8): QuantKernel("int8 weight, F.linear", _pack_int8, _mm_int8_cuda, plain_rows=True),
    ("cuda", 4): QuantKernel("aten._weight_int4pack_mm", _pack_int4_cuda, _mm_int4_cuda),
}


# No dequantized path: the kernel beat a float copy made per call + GEMM at every row count
# measured (1..512, SmolLM2's 120 linears, 1 thread; at 512 rows 1858 vs 2198 ms, loaded box;
# bf16 prepacked 1644), so prefill runs it too (README, "Quantized weights").
INT4_G32 = QuantKernel("radixlm int4_g32_mm", _pack_int4_g32, _mm_int4_g32, dequantize_int4_g32)

# radixlm's int8 kernel on `_pack_int8`'s plain rows and bf16 row scales (the LM head of every
# quantized mode, and `--quantization int8`'s linears): memory-bound at 1 row where torch's
# kernel is compute-bound (README, "Quantized weights").
INT8_ROWS = QuantKernel(
    "radixlm int8_mm",
    _pack_int8,
    _mm_int8_rows,
    _dequantize_int8,
    _mm_dequantized_int8,
    dequant_min_rows=INT8_ROWS_DEQUANT_MIN_ROWS,
    plain_rows=True,
    mm_logits=_mm_int8_logits,
)


def get_kernel(device_type: str, bits: int, dtype: torch.dtype | None = None) -> QuantKernel:
    """The kernel for `bits` on `device_type`; CPU int4 / int8 on bf16 activations (`dtype`)
    take radixlm's own kernels where they run (AVX512_BF16), else torch's."""
    if (device_type, bits, dtype) == ("cpu", 4, torch.bfloat16) and int4_g32_supported():
        return INT4_G32
    if (device_type, bits, dtype) == ("cpu", 8, torch.bfloat16) and int8_rows_supported():
        return INT8_ROWS
    try:
        return KERNELS[(device_type, bits)]
    except KeyError:
        raise ValueError(f"no int{bits} weight-only kernel for device {device_type!r}") from None
