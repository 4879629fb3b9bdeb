"""The compiled CPU forward: the one-call layer stack (`CpuDecoderStack`) against the model's
Python layers on the same fused ops (bit-identical), and the compiled forward against the eager
reference model (`enforce_eager`), float32 and bfloat16, on tiny random Llama / Qwen2 (biases)
models: chunked prefill over the paged prefix, decode steps, and a mixed ragged batch."""

from __future__ import annotations

import pytest
import torch

from radixlm.config import CacheConfig
from radixlm.kernels.cpu import build
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.models.cpu_stack import CpuDecoderStack

if build.load_op() is None:
    pytest.skip(f"CPU ops unavailable: {build.load_error()}", allow_module_level=True)

CPU = torch.device("cpu")
IDS = [(i * 7919) % 40000 + 5 for i in range(40)]


def runner(model_dir, dtype: str, **kw) -> ModelRunner:
    return ModelRunner(model_dir, dtype, CPU, CacheConfig(page_size=4, num_pages=64), **kw)


def steps(r: ModelRunner) -> torch.Tensor:
    """Prefill 0..12, extend 13..29 over it, 3 decodes, then a mixed batch of a second request's
    prefill (pages 16..) with the first one's decode; all logits concatenated."""
    outs, start = [], 0
    pages = list(range(16))
    for n in (13, 17, 1, 1, 1):
        fb = ForwardBatch.build(
            [IDS[start : start + n]], [start], [pages], [list(range(n))], 4, "cpu"
        )
        outs.append(r.forward(fb))
        start += n
    fb = ForwardBatch.build(
        [IDS[start : start + 1], IDS[:9]], [start, 0], [pages, list(range(16, 32))], [[0], [8]],
        4, "cpu",
    )  # fmt: skip
    outs.append(r.forward(fb))
    return torch.cat(outs)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_bias_dir"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_python_layers_and_eager(request, fixture: str, dtype: str) -> None:
    model_dir = request.getfixturevalue(fixture)
    compiled = runner(model_dir, dtype)
    assert compiled.model.stack is not None, "the stack should apply to this model"
    assert compiled.layer_ops == "cpu" and "packed" in compiled.linear_method
    with_stack = steps(compiled)
    python_layers = runner(model_dir, dtype)
    python_layers.model.stack = None  # the same fused ops and packed linears, from Python
    assert torch.equal(with_stack, steps(python_layers))
    eager = runner(model_dir, dtype, enforce_eager=True)
    assert eager.model.stack is None and eager.layer_ops == "torch"
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == "float32" else dict(atol=0.15, rtol=0.05)
    torch.testing.assert_close(with_stack, steps(eager), **tol)


def test_stack_needs_every_piece_compiled(tiny_llama_dir) -> None:
    r = runner(tiny_llama_dir, "float32", attention_backend="torch")
    assert r.model.stack is None
    assert "attention backend" in CpuDecoderStack.unsupported_reason(r.model, r.attn)
