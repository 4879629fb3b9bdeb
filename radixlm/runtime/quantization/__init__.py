"""Weight-only quantized linears (int8 per output channel, int4 group-wise) and GGUF blocks
loaded as they ship. The modes are `radixlm.config.QUANTIZATION_MODES`; kernels by device in
`kernels`, the canonical weight form in `weights`, modules in `modules`, GGUF reading in
`gguf_reader`."""

from __future__ import annotations

from radixlm.runtime.quantization.modules import (
    QuantEmbedding,
    QuantLinear,
    install_quantized,
    quantize_linear,
    quantize_model,
)
from radixlm.runtime.quantization.weights import (
    QuantizedWeight,
    quantize_int4,
    quantize_int8,
)

__all__ = [
    "QuantEmbedding",
    "QuantLinear",
    "QuantizedWeight",
    "install_quantized",
    "quantize_int4",
    "quantize_int8",
    "quantize_linear",
    "quantize_model",
]
