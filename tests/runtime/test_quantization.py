"""Weight-only quantization (`radixlm.runtime.quantization`): each quantized linear against its
dequantized reference, GGUF blocks against gguf's own `dequantize` (bit for bit), the one-call
CPU layer stack against the Python layers on quantized weights (bit for bit), the engine in every
mode, and the flag's validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from radixlm.config import CacheConfig, EngineConfig
from radixlm.kernels.cpu import build
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.grammar.bitmask import apply_token_bitmask_torch
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.models import base
from radixlm.runtime.quantization import (
    QuantEmbedding,
    QuantizedWeight,
    QuantLinear,
    quantize_int4,
    quantize_int8,
    quantize_linear,
)
from radixlm.runtime.quantization.gguf_reader import decode_blocks, iter_gguf
from radixlm.runtime.quantization.kernels import int8_rows_supported

CPU = torch.device("cpu")
IDS = [(i * 7919) % 40000 + 5 for i in range(40)]


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- linears against their dequantized reference ------------------------------------------------


@pytest.mark.parametrize("mode,group", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_quant_linear_matches_dequantized_reference(mode, group, dtype, rows) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True).to(dtype)
    q = quantize_linear(lin, mode, group)
    qw = quantize_int8(lin.weight) if mode == "int8" else quantize_int4(lin.weight, group)
    assert q.bits == qw.bits and q.group_size == qw.group_size
    x = torch.randn(rows, 256, dtype=dtype)
    ref = x.double() @ qw.dequantize().double().t() + lin.bias.double()
    # fp32: the kernels' accumulation order; bf16: activations, scales and output in bf16
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert _relerr(q(x), ref) < tol
    # and the quantization itself stays near the float weight
    assert _relerr(qw.dequantize(), lin.weight) < (0.01 if mode == "int8" else 0.12)


def test_cuda_int4_tiles_divide_k() -> None:
    """tinygemm's packed groups of 16-wide K tiles: the most of 8 / 4 / 2 dividing K."""
    from radixlm.runtime.quantization.kernels import cuda_inner_k_tiles

    assert [cuda_inner_k_tiles(k) for k in (128, 576, 1536, 96, 4096)] == [8, 4, 8, 2, 8]
    with pytest.raises(ValueError, match="K = 80"):
        cuda_inner_k_tiles(80)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [576, 1536, 96])
def test_cuda_int4_linear_matches_dequantized_reference(k: int, dtype: torch.dtype) -> None:
    """SmolLM2's K = 576 is not a multiple of tinygemm's 8 x 16 tiles, and tinygemm takes bf16
    only (the default model's int4 draft failed on CUDA, in a float32 engine too)."""
    torch.manual_seed(0)
    lin = nn.Linear(k, 192, bias=False).to(dtype).cuda()
    q = quantize_linear(lin, "int4", 32)
    x = torch.randn(5, k, dtype=dtype, device="cuda")
    ref = x.double() @ quantize_int4(lin.weight, 32).dequantize().double().t()
    y = q(x)
    assert y.dtype == dtype
    assert _relerr(y, ref) < 1.5e-2


@pytest.mark.parametrize("n,k", [(64, 64), (16, 64), (48, 128), (480, 576), (960, 576)])
def test_int4_cpu_unpack_inverts_the_pack(n: int, k: int) -> None:
    """The learned layout of torch's CPU int4 pack (full blocks of 64 rows and tails)."""
    from radixlm.runtime.quantization.kernels import unpack_int4_cpu

    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack_int4_cpu(packed, n, k).to(torch.int32), q)


@pytest.mark.parametrize("mode,group", [("int8", 0), ("int4", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_inputs_take_the_dequantized_weight(mode, group, dtype, monkeypatch) -> None:
    """torch's kernels (radixlm's int4 g32 kernel, off here, takes every row count)."""
    from radixlm.runtime.quantization import kernels as qk

    monkeypatch.setattr(qk, "int4_g32_supported", lambda: False)
    torch.manual_seed(4)
    lin = nn.Linear(256, 96, bias=True).to(dtype)
    q = quantize_linear(lin, mode, group)
    x = torch.randn(q.kernel.dequant_min_rows, 256, dtype=dtype)
    w = q.kernel.dequantize(q.qweight, q.scales)  # [N, K]
    qw = quantize_int8(lin.weight) if mode == "int8" else quantize_int4(lin.weight, group)
    # the float copy is the weight the kernel multiplies by (rounded to `dtype`)
    assert _relerr(w, qw.dequantize()) < (1e-6 if dtype == torch.float32 else 4e-3)
    kernel = q.kernel.mm(x, q.qweight, q.scales) + q.bias
    assert _relerr(q(x), kernel) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(build.load_op() is None, reason="CPU ops unavailable")
@pytest.mark.parametrize("n,k,group", [(960, 576, 32), (480, 576, 64), (48, 128, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dequantize_op_matches_its_twin(n, k, group, dtype) -> None:
    """The compiled dequantization (full blocks and a tail) against the torch twin: equal in
    float32; in bf16 the op rounds once, from the float32 value, as `.to(bfloat16)` does."""
    from radixlm.runtime.quantization.kernels import (
        _dequantize_int4_cpu,
        get_kernel,
        int4_cpu_blocks,
    )

    torch.manual_seed(5)
    kernel = get_kernel("cpu", 4)
    packed, sz = kernel.pack(quantize_int4(torch.randn(n, k), group), dtype, CPU)
    got = build.load_op().int4_dequantize_t(packed, int4_cpu_blocks(n), sz, k)  # [K, N]
    twin = _dequantize_int4_cpu(packed, sz.float()).t()
    assert torch.equal(got, twin.to(dtype))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_dequantized_product_in_row_chunks(mode: str, monkeypatch) -> None:
    """A weight dequantized a chunk of rows at a time (whole int4 blocks, the tail block last)
    gives the product of the whole dequantized weight."""
    from radixlm.runtime.quantization import kernels

    monkeypatch.setattr(kernels, "DEQUANT_CHUNK_ELEMS", 128 * 256)  # 128-row chunks
    torch.manual_seed(6)
    lin = nn.Linear(256, 480, bias=False)  # 7 blocks of 64 rows and a 32-row tail
    q = quantize_linear(lin, mode, 32)
    x = torch.randn(40, 256)
    ref = x @ q.kernel.dequantize(q.qweight, q.scales).t()
    assert _relerr(q.kernel.mm_dequantized(x, q.qweight, q.scales), ref) < 1e-6


def test_quantizers_bound_the_error_by_half_a_step() -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 128) * torch.rand(48, 1)
    q8 = quantize_int8(w)
    assert (w - q8.dequantize()).abs().le(q8.scales / 2 + 1e-7).all()
    q4 = quantize_int4(w, 32)
    step = q4.scales.repeat_interleave(32, dim=1)
    assert (w - q4.dequantize()).abs().le(step / 2 + 1e-6).all()
    assert q4.q.max() <= 15 and q8.q.abs().max() <= 127


def test_quantized_weight_slices_and_fuses_on_group_boundaries() -> None:
    torch.manual_seed(2)
    a, b = quantize_int4(torch.randn(32, 128), 32), quantize_int4(torch.randn(16, 128), 32)
    fused = QuantizedWeight.cat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    cols = fused.narrow(1, 64, 64)
    assert torch.equal(cols.dequantize(), fused.dequantize()[:, 64:])
    assert torch.equal(fused.narrow(0, 32, 16).dequantize(), b.dequantize())
    with pytest.raises(ValueError, match="groups of 32"):
        fused.narrow(1, 16, 64)
    with pytest.raises(ValueError, match="differ"):
        QuantizedWeight.cat_rows([a, quantize_int4(torch.randn(16, 128), 64)])


def test_embedding_shares_the_int8_head() -> None:
    torch.manual_seed(3)
    emb = torch.randn(160, 64)
    head = QuantLinear(quantize_int8(emb), None, torch.float32, CPU)
    e = QuantEmbedding(head)
    ids = torch.tensor([0, 5, 159, 5])
    assert torch.equal(e(ids), quantize_int8(emb).dequantize()[ids])
    assert e.qweight.data_ptr() == head.qweight.data_ptr()


# ---- GGUF blocks, bit for bit against gguf's own dequantization ---------------------------------


def _random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks with random integers and finite fp16 scales (and mins)."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_1", "Q4_K") else 1
    scales = rng.uniform(-0.05, 0.05, size=(rows, k // block, halves)).astype(np.float16)
    at = size - 2 if type_name == "Q6_K" else 0  # Q6_K keeps its fp16 scale last
    raw[..., at : at + 2 * halves] = scales.view(np.uint8).reshape(rows, k // block, 2 * halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_gguf_blocks_dequantize_bit_exact(type_name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, k = 32, 512
    raw = _random_blocks(type_name, rows, k, np.random.default_rng(0))
    qw = decode_blocks(type_name, raw, rows, k)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, k))
    assert qw.bits == (8 if type_name == "Q8_0" else 4) and qw.group_size == 32
    assert torch.equal(qw.dequantize(), ref)
    if qw.bits == 4:  # and the int4 kernel computes with exactly these integers and scales
        lin = QuantLinear(qw, None, torch.float32, CPU)
        x = torch.randn(3, k)
        assert _relerr(lin(x), x.double() @ ref.double().t()) < 1e-5


def test_gguf_file_maps_blocks_and_dequantizes_the_rest(tmp_path, caplog) -> None:
    """A small .gguf written with gguf's own writer: Q4_1 / Q8_0 tensors come back as blocks
    (bit-exact), F32 as floats, an unmapped type (Q6_K) dequantized by gguf with a log line
    naming tensor and type; q/k rows of a `llama` file are un-permuted, others are not."""
    import logging

    import gguf
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    q41 = quantize(w, gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.ffn_up.weight", q41, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    q80 = quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q80, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q6k = _random_blocks("Q6_K", 64, 256, rng)
    writer.add_tensor("blk.0.ffn_down.weight", q6k, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.add_tensor("blk.0.attn_norm.weight", w[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level(logging.INFO, logger="radixlm.runtime.quantization.gguf_reader"):
        got = dict(iter_gguf(tmp_path / "t.gguf", num_heads=4, num_kv_heads=2))
    up = got["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, QuantizedWeight) and up.source == "Q4_1"
    assert torch.equal(
        up.dequantize(), torch.from_numpy(dequantize(q41, gguf.GGMLQuantizationType.Q4_1))
    )
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert q.source == "Q8_0"
    # llama.cpp's converter permuted the q rows; the reader undoes it as transformers'
    # `_reverse_permute_weights` does: [heads, dim, 2, K] -> swap axes 1, 2
    dq = torch.from_numpy(dequantize(q80, gguf.GGMLQuantizationType.Q8_0))  # [64, 256]
    permuted = dq.reshape(4, 8, 2, 256).transpose(1, 2).reshape(64, 256)
    assert torch.equal(q.dequantize(), permuted)
    down = got["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, torch.Tensor) and down.shape == (64, 256)
    assert torch.equal(down, torch.from_numpy(dequantize(q6k, gguf.GGMLQuantizationType.Q6_K)))
    assert "blk.0.ffn_down.weight has type Q6_K" in caplog.text
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], torch.from_numpy(w[0]))


def test_default_gguf_maps_onto_the_converted_weights(default_model_dir) -> None:
    """The default model's Q4_1 linears and Q8_0 embedding, read as blocks and un-permuted,
    dequantize to exactly the weights transformers dequantized into the converted directory."""
    from safetensors import safe_open

    from radixlm.runtime.models.loader import gguf_source

    wanted = {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.29.self_attn.v_proj.weight",
        "model.layers.0.input_layernorm.weight",
    }
    got = {}
    for name, w in iter_gguf(gguf_source(default_model_dir), 9, 3):
        if name in wanted:
            got[name] = w
    assert set(got) == wanted
    assert got["model.embed_tokens.weight"].source == "Q8_0"
    assert got["model.layers.0.self_attn.q_proj.weight"].source == "Q4_1"
    (file,) = default_model_dir.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as f:
        for name, w in got.items():
            dense = w if isinstance(w, torch.Tensor) else w.dequantize()
            assert torch.equal(dense, f.get_tensor(name).float()), name


# ---- the model: stack vs Python layers, modes vs float ------------------------------------------


def runner(model_dir, dtype: str = "bfloat16", **kw) -> ModelRunner:
    return ModelRunner(model_dir, dtype, CPU, CacheConfig(page_size=4, num_pages=64), **kw)


def steps(r: ModelRunner) -> torch.Tensor:
    """A 13-token prefill, a 17-token extend, then 3 decodes: all logits concatenated."""
    outs, start = [], 0
    for n in (13, 17, 1, 1, 1):
        fb = ForwardBatch.build(
            [IDS[start : start + n]], [start], [list(range(16))], [list(range(n))], 4, "cpu"
        )
        outs.append(r.forward(fb))
        start += n
    return torch.cat(outs)


@pytest.mark.skipif(build.load_op() is None, reason="CPU ops unavailable")
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_bias_dir"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_stack_equals_python_layers(request, fixture: str, mode: str) -> None:
    model_dir = request.getfixturevalue(fixture)
    r = runner(model_dir, quantization=mode, quantization_group_size=32)
    assert r.model.stack is not None, "the stack should take quantized linears"
    assert mode in r.linear_method
    assert isinstance(r.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(r.model.embed_tokens, QuantEmbedding)
    with_stack = steps(r)
    r.model.stack = None
    assert torch.equal(with_stack, steps(r))
    dense = steps(runner(model_dir))
    tol = 0.05 if mode == "int8" else 0.3
    assert _relerr(with_stack, dense) < tol


@pytest.mark.skipif(not int8_rows_supported(), reason="the int8 kernel needs AVX512_BF16")
@pytest.mark.parametrize("mode", ["int8", "none"])
def test_the_lm_head_writes_grammar_masks_into_the_logits(
    tiny_llama_dir, mode: str, monkeypatch
) -> None:
    """``Model.forward``'s ``logits_mask``: asked with the row count right before the LM head,
    its masks come back in the logits (= the plain logits with ``apply_token_bitmask``); a
    mask that answers None, or a head that cannot take masks (fp32), leaves them as they are.
    The int8 head (``int8_mm_logits``) and the bf16 packed one (``linear_bf16_logits``)."""
    fb = ForwardBatch.build(
        [IDS[:5], IDS[5:8], IDS[8:9]], [0, 0, 0], [[0, 1], [2], [3]], [[4], [2], [0]], 4, "cpu"
    )
    gen = torch.Generator().manual_seed(3)
    for dtype, takes in (("bfloat16", True), ("float32", False)):
        r = runner(tiny_llama_dir, dtype, quantization=mode)
        head = type(r.model.lm_head).__name__
        assert head == ("QuantLinear" if mode == "int8" else "PackedLinear"), head
        plain = r.forward(fb)  # [3, V]
        words = (plain.shape[1] + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen).to(torch.int32)
        asked: list[int] = []
        got = r.forward(fb, lambda rows, m=bitmask, a=asked: a.append(rows) or (m, [0, 2]))
        want = plain.clone()
        if takes:
            apply_token_bitmask_torch(want, bitmask, [0, 2])
        assert asked == ([3] if takes else []) and torch.equal(got, want), dtype
        assert torch.equal(r.forward(fb, lambda rows: None), plain)
        # without masks the head's own float32 logits: the bf16 ones widened, bit for bit
        monkeypatch.setattr(base, "FLOAT_HEAD_MAX_ROWS", 0)
        assert torch.equal(r.forward(fb), plain)
        monkeypatch.undo()


@pytest.mark.skipif(build.load_op() is None, reason="CPU ops unavailable")
def test_prefill_past_the_row_threshold_runs_the_python_layers(tiny_llama_dir, monkeypatch) -> None:
    """A long prefill leaves the op for the Python layers and the dequantized weights; with the
    threshold lifted, the same forward through the op and the kernels agrees."""
    from radixlm.runtime.quantization.kernels import KERNELS

    kernel = KERNELS[("cpu", 4)]
    ids = [(i * 7919) % 40000 + 5 for i in range(kernel.dequant_min_rows + 12)]
    fb = ForwardBatch.build([ids], [0], [list(range(64))], [list(range(len(ids)))], 4, "cpu")
    r = ModelRunner(
        tiny_llama_dir, "float32", CPU, CacheConfig(page_size=4, num_pages=64), quantization="int4"
    )
    assert not r.model.stack.takes(len(ids)) and r.model.stack.takes(1)
    dequantized = r.forward(fb)
    lifted = dataclasses.replace(kernel, dequant_min_rows=10**9)
    for m in r.model.modules():
        if isinstance(m, QuantLinear) and m.bits == 4:
            monkeypatch.setattr(m, "kernel", lifted)
    r.model.stack.max_rows = None
    assert _relerr(dequantized, r.forward(fb)) < 1e-5


def test_int4_group_sizes_and_memory(tiny_llama_dir) -> None:
    dense = runner(tiny_llama_dir)
    for g in (32, 64):
        r = runner(tiny_llama_dir, quantization="int4", quantization_group_size=g)
        assert r.model.layers[0].self_attn.qkv_proj.group_size == g
        assert r.weight_bytes < 0.6 * dense.weight_bytes  # tiny: norms and the int8 head weigh
    # 128 does not divide hidden 64: those linears take the largest offered size that does
    r = runner(tiny_llama_dir, quantization="int4", quantization_group_size=128)
    assert r.model.layers[0].self_attn.qkv_proj.group_size == 64


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_int4_lm_head_option(tiny_mqa_dir, tiny_llama_dir, mode: str) -> None:
    """`quantization_lm_head="int4"`: an int4 head beside an int8 embedding (tied or not);
    logits stay near the int8 head's."""
    for model_dir in (tiny_llama_dir, tiny_mqa_dir):
        int8_head = runner(model_dir, quantization=mode)
        r = runner(model_dir, quantization=mode, quantization_lm_head="int4")
        assert r.model.lm_head.bits == 4 and r.model.embed_tokens.qweight.dtype == torch.int8
        assert int8_head.model.lm_head.bits == 8
        assert _relerr(steps(r), steps(int8_head)) < 0.3


def test_gguf_mode_needs_a_gguf_model(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match="needs a .gguf model"):
        runner(tiny_llama_dir, quantization="gguf")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"quantization": "int3"}, "quantization must be one of"),
        ({"quantization": "int4", "quantization_group_size": 48}, "quantization_group_size"),
        ({"quantization": "gguf", "quantization_lm_head": "bf16"}, "quantization_lm_head"),
    ],
)
def test_bad_quantization_flag_is_a_clear_error(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_cli_flag_reaches_the_config() -> None:
    import argparse

    from radixlm.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--quantization", "gguf", "--quantization-group-size", "64"]))
    cfg = EngineConfig.from_kwargs(**kw)
    assert cfg.quantization == "gguf" and cfg.quantization_group_size == 64


# ---- the default model ---------------------------------------------------------------------------


def _zen() -> str:
    """A fixed text nobody here wrote: the Zen of Python."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
        import this

    return codecs.decode(this.s, "rot13")


@pytest.mark.slow
def test_default_model_modes_keep_perplexity_and_shrink_weights(default_model_dir) -> None:
    """Teacher-forced perplexity of a fixed text in each mode against bf16 (the issue's bounds:
    int8 within 2%, int4 within 10%), greedy agreement with bf16 on it, and the weights'
    resident size (int4 / gguf <= 0.35x of bf16's). Every runner computes in the model's bf16
    (`matmul_dtype="model"`): on a CPU without native bf16 "auto" computes in fp32, and the
    rounding of fp32 vs bf16 alone moves this text's perplexity by ~2.5% (measured on an AVX2
    EPYC: bf16 base 22.24, fp32 base 21.70, int8 on fp32 activations 22.50), as much as the
    bound it checks."""
    from radixlm.runtime.models.loader import load_tokenizer

    ids = load_tokenizer(default_model_dir)(_zen())["input_ids"]
    fb = ForwardBatch.build([ids], [0], [list(range(64))], [list(range(len(ids)))], 4, "cpu")

    def loglik(logits: torch.Tensor) -> float:
        lp = torch.log_softmax(logits[:-1].double(), dim=-1)
        return lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()

    base = runner(default_model_dir, matmul_dtype="model")
    ref = base.forward(fb)
    for mode, ppl_bound in (("int8", 1.02), ("int4", 1.10), ("gguf", 1.10)):
        r = runner(default_model_dir, quantization=mode, matmul_dtype="model")
        assert r.model.stack is not None
        out = r.forward(fb)
        ratio = float(np.exp(loglik(ref) - loglik(out)))
        agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert ratio <= ppl_bound and agree >= 0.85, (mode, ratio, agree)
        if mode != "int8":
            # torch's int4 layout (CPUs where radixlm's int4 kernel does not run: no
            # AVX512_BF16) keeps [K / 32, N, 2] scales and zeros: 0.352x, measured on AVX2
            from radixlm.runtime.quantization import kernels

            ours = kernels.int4_g32_supported()
            bound = 0.35 if ours else 0.36
            assert r.weight_bytes <= bound * base.weight_bytes, (mode, r.weight_bytes)


# ---- the engine end to end -----------------------------------------------------------------------


def _greedy_by_hand(r: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Prefill, then n - 1 decode steps, argmax each: what the engine should produce."""
    ids, out = list(prompt), []
    pages = list(range(16))
    fb = ForwardBatch.build([ids], [0], [pages], [[len(ids) - 1]], 4, "cpu")
    for _ in range(n):
        tok = int(r.forward(fb).argmax(-1)[0])
        out.append(tok)
        fb = ForwardBatch.build([[tok]], [len(ids)], [pages], [[0]], 4, "cpu")
        ids.append(tok)
    return out


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_generates_with_quantized_weights(tiny_llama_dir, mode: str) -> None:
    from radixlm import Engine, SamplingParams

    prompt = [5, 17, 400, 9, 23, 1000]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", num_threads=1, page_size=4, num_pages=64)
    with Engine(model=str(tiny_llama_dir), quantization=mode, **kw) as engine:
        assert isinstance(engine.runner.model.layers[0].mlp.down_proj, QuantLinear)
        got = engine.generate(prompt, greedy).outputs[0].output_token_ids
    ref = _greedy_by_hand(runner(tiny_llama_dir, "float32", quantization=mode), prompt, 8)
    assert got == ref


@pytest.mark.slow
def test_engine_serves_the_default_gguf_as_it_ships(default_model_dir) -> None:
    from radixlm import Engine, SamplingParams

    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    with Engine(quantization="gguf", device="cpu", num_threads=1, num_pages=256) as engine:
        # the shipped file is 98.6 MB; bf16 weights would be 270 MB. Where the CPU computes in
        # fp32 (no native bf16), torch's int4 kernel keeps its scales in fp32: 108 MB.
        bound = 100e6 if engine.runner.compute_dtype == torch.bfloat16 else 110e6
        assert engine.runner.weight_bytes < bound
        text = engine.generate("The capital of France is", greedy).outputs[0].text
    assert "Paris" in text


@pytest.mark.slow
def test_int4_g32_kernel_generates_as_torchs_int4_on_the_default_model(
    default_model_dir, monkeypatch
) -> None:
    """The default GGUF's Q4_1 blocks through radixlm's int4 kernel (`int4_gemm.cpp`) and through
    torch's (`int4_g32_supported` off), same weights: the engine's greedy tokens agree for the
    first 8 tokens of every prompt, and teacher-forced on torch's greedy sequences the two give
    the same log-probabilities up to rounding (torch's path rounds the scales and zeros to bf16,
    the kernel keeps the fp16 ones, so where greedy paths part after a near tie is not a
    property of either kernel)."""
    from radixlm import Engine, SamplingParams
    from radixlm.runtime.quantization import kernels as qk

    if not qk.int4_g32_supported():
        pytest.skip("the int4 g32 kernel needs the built op and AVX512_BF16")
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    forced = SamplingParams(max_new_tokens=1, temperature=0.0, logprob_start_len=0)

    def generate(sequences: list[list[int]] | None):
        with Engine(quantization="gguf", device="cpu", num_threads=1, num_pages=256) as engine:
            name = engine.runner.model.layers[0].mlp.down_proj.kernel.name
            ids = [engine.tokenize(p) for p in prompts]
            outs = [engine.generate(i, greedy).outputs[0].output_token_ids for i in ids]
            seqs = sequences or [i + o for i, o in zip(ids, outs)]
            lps = [engine.generate(q, forced).prompt_logprobs[1:] for q in seqs]
        return name, outs, seqs, lps

    monkeypatch.setattr(qk, "int4_g32_supported", lambda: False)
    torch_name, theirs, seqs, their_lps = generate(None)
    monkeypatch.undo()
    ours_name, ours, _, our_lps = generate(seqs)
    assert ours_name == qk.INT4_G32.name and torch_name == qk.KERNELS[("cpu", 4)].name
    prefix = [
        next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), len(o))
        for o, t in zip(ours, theirs)
    ]
    assert min(prefix) >= 8, (prefix, ours, theirs)
    diffs = [abs(a - b) for o, t in zip(our_lps, their_lps) for a, b in zip(o, t)]
    mean = sum(diffs) / len(diffs)
    assert mean < 0.05 and max(diffs) < 1.0, (mean, max(diffs))  # measured: 0.024, 0.20


def test_quantized_weights_move_to_huge_pages_once_when_tied() -> None:
    """`move_weights_to_huge_pages` moves low-bit weights and scales into per-dtype arenas (in
    huge pages when they span one); a tied int8 head and embedding keep sharing one copy; the
    outputs are unchanged."""
    from radixlm.runtime.models.cpu_linear import move_weights_to_huge_pages

    torch.manual_seed(0)
    head = quantize_linear(nn.Linear(1024, 4096, bias=False), "int8", 32)  # 4 MB of int8
    model = nn.ModuleDict({"head": head, "embed": QuantEmbedding(head)})
    x, ids = torch.randn(3, 1024), torch.tensor([1, 7, 4095])
    before = (head(x), model["embed"](ids))
    moved = move_weights_to_huge_pages(model)
    assert moved == head.qweight.numel() + head.scales.numel() * head.scales.element_size()
    assert head.qweight.data_ptr() % (2 << 20) == 0
    assert model["embed"].qweight.data_ptr() == head.qweight.data_ptr()
    assert "qweight" in dict(head.named_buffers())  # still a buffer
    torch.testing.assert_close(head(x), before[0])
    torch.testing.assert_close(model["embed"](ids), before[1])
