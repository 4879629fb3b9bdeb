"""Sparse MoE families (Qwen3-MoE with norm_topk_prob, Mixtral, OLMoE with its full-width q/k
norms and clip_qkv) against transformers, float32;
the grouped expert computation against a per-token loop."""

from __future__ import annotations

import pytest
import torch
from family_check import assert_engine_matches_generate, assert_logits_match

from radixlm.runtime.models.moe import SparseMoeBlock, route


@pytest.fixture(scope="module")
def tiny_qwen3_moe_dir(make_tiny_model):
    return make_tiny_model(
        "qwen3_moe",
        seed=8,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # layer 1 is a dense MLP
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def tiny_mixtral_dir(make_tiny_model):
    return make_tiny_model(
        "mixtral",
        seed=9,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
        sliding_window=None,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def tiny_olmoe_dir(make_tiny_model):
    return make_tiny_model(
        "olmoe",
        seed=12,
        num_experts=8,
        num_experts_per_tok=2,
        intermediate_size=32,
        clip_qkv=2.0,
        tie_word_embeddings=False,
    )


FAMILIES = ["tiny_qwen3_moe_dir", "tiny_mixtral_dir", "tiny_olmoe_dir"]


@pytest.mark.parametrize("fixture", FAMILIES)
@pytest.mark.parametrize("chunks", [[30], [7, 13, 10]])
def test_logits_match_transformers(request, fixture, chunks):
    ids = [(i * 7919) % 40000 + 5 for i in range(30)]
    assert_logits_match(request.getfixturevalue(fixture), ids, chunks)


@pytest.mark.parametrize("fixture", FAMILIES)
def test_engine_greedy_matches_generate(request, fixture):
    assert_engine_matches_generate(request.getfixturevalue(fixture))


def test_qwen3_moe_dense_and_sparse_layers(tiny_qwen3_moe_dir):
    runner = assert_logits_match(tiny_qwen3_moe_dir, list(range(5, 25)), [20])
    layers = runner.model.layers
    assert isinstance(layers[0].mlp, SparseMoeBlock)
    assert not isinstance(layers[1].mlp, SparseMoeBlock)


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_per_token_loop(renormalize):
    torch.manual_seed(0)
    block = SparseMoeBlock(hidden=32, intermediate=24, num_experts=6, top_k=3,
                           renormalize=renormalize)  # fmt: skip
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        x = torch.randn(17, 32)  # [T, H]
        got = block(x)
        weights, experts = route(block.gate(x), 3, renormalize)
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(3):
                e = int(experts[t, j])
                gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)
                h = torch.nn.functional.silu(gate) * up
                want[t] += weights[t, j] * (block.experts.down_proj[e] @ h)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(17))


def test_int8_quantizes_attention_and_keeps_experts_dense(tiny_qwen3_moe_dir):
    from family_check import run_chunks

    from radixlm.config import CacheConfig
    from radixlm.runtime.model_runner import ModelRunner
    from radixlm.runtime.quantization import QuantLinear

    runner = ModelRunner(
        tiny_qwen3_moe_dir, "float32", torch.device("cpu"), CacheConfig(page_size=4, num_pages=8),
        quantization="int8",
    )  # fmt: skip
    layers = runner.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, QuantLinear)
    assert isinstance(layers[1].mlp.gate_up_proj, QuantLinear)  # the dense layer
    assert layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    logits = run_chunks(runner, list(range(5, 25)), [20])
    assert logits.shape == (20, 49152) and torch.isfinite(logits).all()
