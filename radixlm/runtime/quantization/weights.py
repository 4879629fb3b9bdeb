"""Quantized weights in one canonical, kernel-independent form, and the quantizers that make them.

`QuantizedWeight` holds the integers and per-group scales of an `[N, K]` matrix exactly as a
source stores them (a GGUF block type, or our own quantizer), in float32, so that
`dequantize()` reproduces the source's own dequantization bit for bit; the kernel layouts
(`radixlm.runtime.quantization.kernels`) are derived from it at pack time. It can be sliced
(tensor-parallel shards) and concatenated (fused q/k/v and gate/up) without dequantizing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.config import INT4_GROUP_SIZES

BITS = (8, 4)


@dataclass(frozen=True)
class QuantizedWeight:
    """`w[n, k] = q[n, k] * scales[n, k // group_size] (+ mins[n, k // group_size])`, in float32.

    bits 8: `q` int8 in [-128, 127], no `mins` (symmetric). bits 4: `q` uint8 in [0, 15], `mins`
    always set (Q4_0's symmetric `d * (q - 8)` has `mins = -8 d`). `source` names the format
    it came from ("int8", "int4", "Q4_1", ...) for logs. Invariant: `K % group_size == 0`.
    """

    bits: int
    q: torch.Tensor  # [N, K] int8 | uint8
    scales: torch.Tensor  # [N, K // group_size] float32
    mins: torch.Tensor | None  # [N, K // group_size] float32 (bits 4)
    group_size: int
    source: str

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits}")
        if k % self.group_size or self.scales.shape != (n, k // self.group_size):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} do not match q {tuple(self.q.shape)} in "
                f"groups of {self.group_size}"
            )
        if (self.mins is None) != (self.bits == 8):
            raise ValueError("int4 weights carry mins; int8 weights do not")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        g = self.group_size
        s = self.scales.repeat_interleave(g, dim=1)
        w = self.q.float() * s
        if self.mins is not None:
            w = w + self.mins.repeat_interleave(g, dim=1)
        return w

    def narrow(self, dim: int, start: int, size: int) -> QuantizedWeight:
        """Rows (dim 0) or input columns (dim 1 / -1, on group boundaries) of this weight: the
        tensor-parallel slicing of `radixlm.runtime.distributed.sharding`."""
        if dim == 0:
            return QuantizedWeight(
                self.bits,
                self.q.narrow(0, start, size),
                self.scales.narrow(0, start, size),
                None if self.mins is None else self.mins.narrow(0, start, size),
                self.group_size,
                self.source,
            )
        g = self.group_size
        if start % g or size % g:
            raise ValueError(
                f"a {self.source} weight splits its input columns only on its groups of {g} "
                f"(asked for columns {start}..{start + size})"
            )
        return QuantizedWeight(
            self.bits,
            self.q.narrow(1, start, size),
            self.scales.narrow(1, start // g, size // g),
            None if self.mins is None else self.mins.narrow(1, start // g, size // g),
            g,
            self.source,
        )

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Stack output rows (fused q/k/v, gate/up); parts must share bits and group size."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size for p in parts):
            raise ValueError("fused parts differ in format or group size")
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
        return QuantizedWeight(
            first.bits,
            torch.cat([p.q for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
            first.group_size,
            first.source,
        )


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per output channel: `scale = amax(|w[n]|) / 127`."""
    w = w.detach().float()  # [N, K]
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q, scales, None, w.shape[1], "int8")


def quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` inputs (Q4_1's scheme): `scale = (max - min) /
    15`, `min` the group's minimum, `q = round((w - min) / scale)`."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide K={k}")
    wg = w.detach().float().reshape(n, k // group_size, group_size)  # [N, G, g]
    lo = wg.amin(dim=2)
    hi = wg.amax(dim=2)
    scales = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)  # [N, G]
    q = torch.round((wg - lo[..., None]) / scales[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(4, q.reshape(n, k), scales, lo, group_size, "int4")


def requantize_per_channel_int8(qw: QuantizedWeight) -> QuantizedWeight:
    """A per-output-channel int8 copy of a group-wise weight (the int8 kernel has one scale per
    row): exact when the groups already share one scale, else the rounding of `quantize_int8`."""
    if qw.bits == 8 and qw.group_size == qw.shape[1]:
        return qw
    out = quantize_int8(qw.dequantize())
    return QuantizedWeight(8, out.q, out.scales, None, out.group_size, f"{qw.source}->int8")


def int4_group_for(k: int, group_size: int) -> int:
    """`group_size` if it divides K, else the largest offered group size that does."""
    if k % group_size == 0:
        return group_size
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g < group_size and k % g == 0:
            return g
    raise ValueError(f"no int4 group size of {INT4_GROUP_SIZES} divides K={k}")
