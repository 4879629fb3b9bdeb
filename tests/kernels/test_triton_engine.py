"""End to end: the engine with `attention_backend="triton"` (Triton's interpreter on CPU) gives
the same greedy tokens as with `"torch"` on a tiny random-weight Llama; and backend selection."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from radixlm import Engine, SamplingParams
from radixlm.config import CacheConfig
from radixlm.kernels.cpu.build import load_op
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.kernels.registry import available_backends, resolve_backend_name
from radixlm.runtime.model_runner import ModelRunner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)

SHARED = [(i * 7919) % 40000 + 5 for i in range(11)]  # 11 tokens: not a multiple of page_size 4
ROUND_1 = [SHARED + [101, 102], [7, 8, 9], SHARED[:6] + [55] * 9, [3]]
# Round 2 hits the radix cache (prefix pages shared with round 1), then extends over them.
ROUND_2 = [SHARED + [103, 104, 105], SHARED + [101, 102, 106]]


def run(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    out = []
    for prompts in (ROUND_1, ROUND_2):
        out += [r.output_token_ids for r in engine.generate(prompts, params)]
    assert engine.wait_idle(timeout=30)
    engine.check_integrity()
    return out


def make_engine(model_dir, backend: str) -> Engine:
    # chunked_prefill_size 8: long prompts are prefilled in chunks over their own prefix.
    return Engine(
        str(model_dir),
        dtype="float32",
        attention_backend=backend,
        num_pages=64,
        page_size=4,
        chunked_prefill_size=8,
        num_threads=1,
    )


_TORCH_TOKENS: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("num_kv_splits", [None, 2])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_triton_engine_matches_torch_engine(request, model, num_kv_splits):
    """NOTE: the tiny Llama (tied embeddings) greedily repeats its last token, which says little
    about attention; the tiny Qwen2 (untied lm_head, biases) gives varied tokens."""
    model_dir = request.getfixturevalue(model)
    if model not in _TORCH_TOKENS:
        with make_engine(model_dir, "torch") as engine:
            assert engine.runner.attention_backend_name == "torch"
            _TORCH_TOKENS[model] = run(engine)
    with make_engine(model_dir, "triton") as engine:
        assert type(engine.runner.attn).__name__ == "TritonAttentionBackend"
        engine.runner.attn.force_num_kv_splits = num_kv_splits  # before any request: no race
        tokens = run(engine)
    assert all(len(t) == 4 for t in tokens)
    assert tokens == _TORCH_TOKENS[model]


def test_triton_runner_logits_match_torch_runner(tiny_llama_dir):
    """Logits of every position (chunked prefill over the paged prefix, then decode steps) agree
    between the two backends: a finer check than greedy tokens."""
    ids = [(i * 7919) % 40000 + 5 for i in range(23)]
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(
            tiny_llama_dir,
            "float32",
            torch.device(DEVICE),
            CacheConfig(page_size=4, num_pages=8),
            attention_backend=backend,
        )
        assert runner.attention_backend_name == backend
        # The triton backend also runs the fused RMSNorm(+residual) and RoPE kernels.
        assert (runner.layer_ops == "triton") == (backend == "triton")
        assert runner.model.layer_ops.name == runner.layer_ops
        pages = list(range(6))
        outs, start = [], 0
        for n in (7, 13, 1, 1, 1):  # prefill 0..6, extend 7..19 over the prefix, 3 decodes
            batch = ForwardBatch.build(
                [ids[start : start + n]], [start], [pages], [list(range(n))], 4, DEVICE
            )
            outs.append(runner.forward(batch))
            start += n
        logits[backend] = torch.cat(outs)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_auto_backend_resolution():
    assert "triton" in available_backends()
    assert resolve_backend_name("auto", "cuda") == "triton"
    # On CPU `auto` is the compiled op when it builds (tests/kernels/test_cpu_attention.py).
    cpu_auto = "cpu" if load_op() is not None else "torch"
    assert resolve_backend_name("auto", "cpu") == cpu_auto
    assert resolve_backend_name("triton", "cpu") == "triton"  # forced
    assert resolve_backend_name("torch", "cuda") == "torch"


def test_import_without_triton_and_without_interpreter():
    """`import radixlm` (and the torch backend) never needs triton; asking for triton without it
    is a clear error; on CPU without TRITON_INTERPRET the triton backend refuses."""
    code = """
import sys
sys.modules["triton"] = None  # make `import triton` fail
import radixlm, radixlm.kernels.registry as reg
import torch
from radixlm.kernels.forward_batch import KVCache
cache = KVCache.allocate(1, 2, 4, 1, 16, torch.float32, "cpu")
reg.create_attention_backend("torch", cache)
assert reg.resolve_backend_name("auto", "cuda") == "torch"
try:
    reg.create_attention_backend("triton", cache)
except ImportError as e:
    assert "triton" in str(e)
    print("ok")
"""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    code = """
import torch, radixlm.kernels.registry as reg
from radixlm.kernels.forward_batch import KVCache
cache = KVCache.allocate(1, 2, 4, 1, 16, torch.float32, "cpu")
try:
    reg.create_attention_backend("triton", cache)
except RuntimeError as e:
    assert "TRITON_INTERPRET" in str(e)
    print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
