"""Tensor parallelism (gloo, 2 ranks, float32) for the families whose checkpoint names the
sharding slices: Qwen3 (per-head q/k norms replicated), Gemma 3 (sliding-window layers, four
norms), Phi-3 (checkpoint-fused qkv / gate_up), Qwen3-MoE and Mixtral (every expert's width
split, the block's output all-reduced): rank 0's logits equal TP=1's on a prefill
longer than the window and a decode step; the families that cannot be sharded are refused
before anything loads."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.errors import ConfigError
from radixlm.runtime.models.registry import check_tensor_parallel


@pytest.fixture(scope="module")
def tp_qwen3_dir(make_tiny_model):
    return make_tiny_model("qwen3", seed=21, head_dim=16)


@pytest.fixture(scope="module")
def tp_gemma3_dir(make_tiny_model):
    return make_tiny_model(
        "gemma3_text", seed=22, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip


@pytest.fixture(scope="module")
def tp_phi3_dir(make_tiny_model):
    return make_tiny_model("phi3", seed=23, pad_token_id=0)


@pytest.fixture(scope="module")
def tp_qwen3_moe_dir(make_tiny_model):
    return make_tiny_model(
        "qwen3_moe", seed=24, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
    )  # fmt: skip


@pytest.fixture(scope="module")
def tp_mixtral_dir(make_tiny_model):
    return make_tiny_model("mixtral", seed=25, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize(
    "fixture",
    ["tp_qwen3_dir", "tp_gemma3_dir", "tp_phi3_dir", "tp_qwen3_moe_dir", "tp_mixtral_dir"],
)
def test_tp2_logits_match_tp1(fixture: str, request: pytest.FixtureRequest) -> None:
    from radixlm.config import CacheConfig
    from radixlm.kernels.forward_batch import ForwardBatch
    from radixlm.runtime.distributed.parallel_state import DistributedConfig
    from radixlm.runtime.distributed.tp_runner import TensorParallelRunner
    from radixlm.runtime.model_runner import ModelRunner

    model_dir = request.getfixturevalue(fixture)
    cache = CacheConfig(page_size=4, num_pages=16)
    args = (model_dir, "float32", torch.device("cpu"), cache, "torch", None)
    ids = [(i * 7919) % 40000 + 5 for i in range(10)]
    prefill = ForwardBatch.build(
        [ids, [9, 8, 7]], [0, 0], [[0, 1, 2], [3]], [[9], [0, 1, 2]], 4, "cpu"
    )
    decode = ForwardBatch.build([[11], [12]], [10, 3], [[0, 1, 2], [3]], [[0], [0]], 4, "cpu")
    one = ModelRunner(*args)
    ref = [one.forward(prefill), one.forward(decode)]
    tp = TensorParallelRunner(*args, DistributedConfig.from_env(2), num_threads=1)
    try:
        got = [tp.forward(prefill), tp.forward(decode)]
    finally:
        tp.shutdown()
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["OlmoeForCausalLM"])
def test_unsharded_families_are_refused(arch: str) -> None:
    check_tensor_parallel(arch, 1)
    with pytest.raises(ConfigError, match="tensor parallelism"):
        check_tensor_parallel(arch, 2)
