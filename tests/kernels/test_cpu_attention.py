"""The compiled CPU paged-attention op (backend "cpu") against the torch twin and dense SDPA:
ragged lengths (1, page boundaries, ~2k), page sizes 1/4/16/64, GQA ratios 1/3/8, head dims
64/128, fp32/bf16/fp16, decode-only / extend-only / mixed batches, prefix 0 and > 0, split-KV
on and off; the engine end to end vs the torch backend; the fallback when the op cannot build."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from radixlm import Engine, SamplingParams
from radixlm.config import CacheConfig
from radixlm.kernels.cpu import build
from radixlm.kernels.forward_batch import KVCache
from radixlm.kernels.registry import create_attention_backend, resolve_backend_name
from radixlm.runtime.model_runner import ModelRunner

if build.load_op() is None:
    pytest.skip(f"CPU attention op unavailable: {build.load_error()}", allow_module_level=True)

# (prefix, new) per request: decode rows (new == 1) of length 1, at page boundaries, ~2k; extend
# rows with prefix 0 and > 0, lengths across page boundaries.
DECODE = [(0, 1), (3, 1), (15, 1), (16, 1), (63, 1), (64, 1), (200, 1)]
EXTEND = [(0, 5), (0, 17), (4, 12), (13, 40), (64, 64), (100, 3)]
MIXED = [(0, 1), (17, 1), (0, 33), (48, 1), (5, 11), (130, 1), (64, 20)]
LONG = [(2047, 1), (1900, 1), (1500, 100)]
SCALE = 0.125


def run_op(case, splits: int | None = None) -> tuple[torch.Tensor, Any]:
    """The "cpu" backend (store + op) on a copy of the case's cache: (output, backend)."""
    cache = KVCache([case.k_buf.clone()], [case.v_buf.clone()], case.cache.page_size)
    backend = create_attention_backend("cpu", cache)
    backend.force_num_kv_splits = splits
    backend.init_forward(case.batch)
    out = backend.forward(0, case.q, case.k_new, case.v_new, SCALE)
    # The new K/V were stored where the twin stores them.
    loc = case.batch.out_cache_loc
    assert torch.equal(cache.k_buffers[0][loc], case.k_new.to(cache.k_buffers[0].dtype))
    assert torch.equal(cache.v_buffers[0][loc], case.v_new.to(cache.v_buffers[0].dtype))
    return out, backend


def check(case, splits: int | None = None) -> int:
    out, backend = run_op(case, splits)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    dense = case.dense_reference(SCALE)
    tol = case.tol()
    torch.testing.assert_close(out.float(), dense, atol=tol, rtol=tol)
    twin = case.torch_twin(SCALE)
    # The twin computes in q's dtype (bf16 SDPA): allow its error on top of ours.
    twin_tol = tol if case.q.dtype == torch.float32 else 2 * tol
    torch.testing.assert_close(out.float(), twin.float(), atol=twin_tol, rtol=twin_tol)
    return backend.plan.num_kv_splits


GQA = [(4, 4), (6, 2), (8, 1)]  # ratios 1, 3, 8


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
@pytest.mark.parametrize("heads", GQA, ids=["gqa1", "gqa3", "gqa8"])
def test_mixed_batch_matches_twin_and_dense(paged_case, page_size, heads):
    """Every page size x GQA ratio on a mixed batch; head dim and dtype alternate so that each
    of 64/128 and fp32/bf16 meets every page size and every ratio."""
    hq, hkv = heads
    i = [1, 4, 16, 64].index(page_size) + GQA.index(heads)
    d = (64, 128)[i % 2]
    dtype = (torch.float32, torch.bfloat16)[(i // 2) % 2]
    check(paged_case(MIXED, hq, hkv, d, page_size, dtype, seed=i, device="cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shapes", [DECODE, EXTEND], ids=["decode", "extend"])
def test_decode_only_and_extend_only(paged_case, shapes, dtype):
    case = paged_case(shapes, 9, 3, 64, 16, dtype, seed=3, device="cpu")
    check(case, splits=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 8, None])
def test_long_contexts_split_kv(paged_case, splits, dtype):
    """~2k-token decode rows with split-KV forced off / on (uneven splits) / by the heuristic,
    next to a long extend row."""
    case = paged_case(LONG, 9, 3, 64, 16, dtype, seed=5, device="cpu")
    used = check(case, splits=splits)
    if splits is not None:
        assert used == splits


def test_head_dim_not_multiple_of_16_uses_the_twin(paged_case, caplog):
    """The op's tiles need head_dim % 16 == 0; other head dims run the torch twin (logged)."""
    case = paged_case(MIXED, 4, 2, 40, 4, torch.float32, seed=8, device="cpu")
    with caplog.at_level(logging.WARNING):
        out, _ = run_op(case)
    assert "head_dim" in caplog.text
    torch.testing.assert_close(out, case.dense_reference(SCALE), atol=case.tol(), rtol=case.tol())


def test_split_heuristic_single_long_decode(paged_case):
    """Batch 1 with a long context splits (fills the threads); many short decodes do not."""
    from radixlm.kernels.cpu.plan import choose_num_kv_splits

    assert choose_num_kv_splits(1, 4096, 2) > 1
    assert choose_num_kv_splits(64, 512, 2) == 1
    assert choose_num_kv_splits(1, 100, 2) == 1  # too short to split
    case = paged_case([(4000, 1)], 9, 3, 64, 16, torch.bfloat16, seed=6, device="cpu")
    assert check(case) > 1


def test_threads_agree(paged_case):
    """2 threads give the same result as 1 (tasks are independent; no reduction across them)."""
    case = paged_case(MIXED + LONG, 9, 3, 64, 16, torch.float32, seed=7, device="cpu")
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_op(case, splits=4)
        torch.set_num_threads(2)
        two, _ = run_op(case, splits=4)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


SHARED = [(i * 7919) % 40000 + 5 for i in range(11)]
ROUND_1 = [SHARED + [101, 102], [7, 8, 9], SHARED[:6] + [55] * 9, [3]]
ROUND_2 = [SHARED + [103, 104, 105], SHARED + [101, 102, 106]]


def run_engine(model_dir, backend: str) -> list[list[int]]:
    engine = Engine(
        str(model_dir),
        dtype="float32",
        attention_backend=backend,
        num_pages=64,
        page_size=4,
        chunked_prefill_size=8,
        num_threads=1,
        device="cpu",  # the CPU op's engine, also on a machine with CUDA
    )
    with engine:
        assert engine.runner.attention_backend_name == backend
        params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        out = []
        for prompts in (ROUND_1, ROUND_2):
            out += [r.output_token_ids for r in engine.generate(prompts, params)]
        assert engine.wait_idle(timeout=30)
        engine.check_integrity()
    return out


def test_engine_matches_torch_engine(tiny_qwen2_dir):
    """Greedy tokens with chunked prefill over paged prefixes, radix-cache hits and decode are
    identical to the torch backend (tiny Qwen2: untied lm_head and biases give varied tokens)."""
    tokens = run_engine(tiny_qwen2_dir, "cpu")
    assert all(len(t) == 6 for t in tokens)
    assert tokens == run_engine(tiny_qwen2_dir, "torch")


def test_engine_shared_prefix_items_match_torch_engine(tiny_qwen2_dir, monkeypatch):
    """Concurrent requests behind one 150-token prompt (a radix hit for all but the first):
    their decode rows attend to the shared pages in shared-prefix items, and the greedy tokens
    are those of the torch backend."""
    from radixlm.kernels.cpu import backend as cpu_backend

    planned: list[int] = []
    real_plan = cpu_backend.plan_work

    def spy(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        planned.append(plan.num_shared_items)
        return plan

    monkeypatch.setattr(cpu_backend, "plan_work", spy)
    system = [(i * 7919) % 40000 + 5 for i in range(150)]
    prompts = [system + [11 + i, 12 + 2 * i] for i in range(4)]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    out = {}
    for backend in ("cpu", "torch"):
        engine = Engine(
            str(tiny_qwen2_dir),
            dtype="float32",
            attention_backend=backend,
            num_pages=256,
            page_size=4,
            num_threads=1,
            device="cpu",
        )
        with engine:
            engine.generate([system + [5]], SamplingParams(max_new_tokens=1))  # cache it
            out[backend] = [r.output_token_ids for r in engine.generate(prompts, params)]
            assert engine.wait_idle(timeout=30)
            engine.check_integrity()
    assert max(planned) >= 1
    assert out["cpu"] == out["torch"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_logits_match_torch_runner(tiny_llama_dir, dtype, runner_logits):
    """Logits of every position (prefill, extend over the paged prefix, decodes) agree."""
    logits = {}
    for backend in ("torch", "cpu"):
        runner = ModelRunner(
            tiny_llama_dir,
            dtype,
            torch.device("cpu"),
            CacheConfig(page_size=4, num_pages=8),
            attention_backend=backend,
        )
        logits[backend] = runner_logits(runner, (7, 13, 1, 1, 1), 6)
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(logits["cpu"], logits["torch"], atol=tol, rtol=tol)


def test_auto_picks_cpu_when_available():
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert resolve_backend_name("torch", "cpu") == "torch"


def test_second_load_uses_the_cache():
    """A fresh process loads the built library from the cache without rebuilding it."""
    lib = build.build_dir() / f"{build.NAME}.so"
    assert lib.exists()
    before = lib.stat().st_mtime_ns
    code = (
        "import time, torch; from radixlm.kernels.cpu import build; t = time.perf_counter(); "
        "op = build.load_op(); print(op is not None, time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ok, seconds = out.stdout.split()
    assert ok == "True", out.stdout + out.stderr
    assert lib.stat().st_mtime_ns == before
    print(f"load from cache: {float(seconds) * 1e3:.0f} ms")


def test_fallback_when_the_op_cannot_build(tmp_path):
    """No compiler (CXX=/bin/false) and an empty build cache: `auto` logs ONE line and picks
    `torch`, the engine serves, and asking for `cpu` explicitly is a clear ImportError."""
    code = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")
from radixlm.kernels import registry
from radixlm.kernels.forward_batch import KVCache
assert registry.resolve_backend_name("auto", "cpu") == "torch"
assert registry.resolve_backend_name("auto", "cpu") == "torch"  # no second log line
cache = KVCache.allocate(1, 2, 4, 1, 16, torch.float32, "cpu")
registry.create_attention_backend("torch", cache)
try:
    registry.create_attention_backend("cpu", cache)
except ImportError as e:
    assert "could not be built" in str(e)
    print("ok")
"""
    env = dict(os.environ, RADIXLM_CACHE=str(tmp_path), CXX="/bin/false", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
    logs = [ln for ln in out.stderr.splitlines() if ln.startswith("LOG")]
    assert len(logs) == 1 and "CPU attention op unavailable" in logs[0], out.stderr
    assert "using the torch attention backend" in logs[0]


def test_fallback_logs_once_in_process(monkeypatch, caplog):
    """The loader failing (monkeypatched) is reported once and remembered."""

    def fail(verbose: bool = False):
        raise OSError("simulated load failure")

    monkeypatch.setattr(build, "_build", fail)
    monkeypatch.setattr(build, "_op", None)
    monkeypatch.setattr(build, "_error", None)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load_op() is None
        assert build.load_op() is None
        assert resolve_backend_name("auto", "cpu") == "torch"
    assert len(caplog.records) == 1
    assert "simulated load failure" in caplog.records[0].getMessage()


# Decode rows of three groups sharing 64 / 256 / 512 leading keys on the same pages (a system
# prompt after a radix hit), a row on its own, and extend rows between them.
SHARED_SHAPES = [
    (300, 1),
    (0, 9),
    (301, 1),
    (520, 1),
    (512, 1),
    (260, 1),
    (700, 1),
    (64, 12),
    (400, 1),
    (513, 1),
    (90, 1),
]
SHARED_GROUPS = [0, -1, 0, 1, 1, 0, 1, -1, 0, 1, 2]


def run_planned(case, **knobs: Any) -> tuple[torch.Tensor, Any]:
    """The "cpu" backend with plan knobs set (`min_shared_tokens`, `min_tokens_per_split`)."""
    cache = KVCache([case.k_buf.clone()], [case.v_buf.clone()], case.cache.page_size)
    backend = create_attention_backend("cpu", cache)
    for name, value in knobs.items():
        setattr(backend, name, value)
    backend.init_forward(case.batch)
    return backend.forward(0, case.q, case.k_new, case.v_new, SCALE), backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128), (4, 4, 64)], ids=str)
@pytest.mark.parametrize("shared_tokens", [256, 512])
@pytest.mark.parametrize("split_at", [256, 48], ids=["whole", "split"])
def test_shared_prefix_items_match_dense(paged_case, dtype, heads, shared_tokens, split_at):
    """Decode rows whose first pages are the same physical pages attend to them in one
    shared-prefix item (each K/V block read once for all of them; "split": the shared keys
    and each row's own keys cut into several partials), their own keys apart, and a reduce
    combines them: the output matches dense SDPA, the torch twin and the plan without
    shared items."""
    hq, hkv, d = heads
    groups = [g if g != 2 else -1 for g in SHARED_GROUPS]  # group 2 would be a group of one
    # rows not longer than the shared run stay out of the groups
    groups = [g if p > shared_tokens else -1 for g, (p, _) in zip(groups, SHARED_SHAPES)]
    case = paged_case(
        SHARED_SHAPES,
        hq,
        hkv,
        d,
        16,
        dtype,
        seed=11,
        device="cpu",
        groups=groups,
        shared_tokens=shared_tokens,
    )
    out, backend = run_planned(case, min_tokens_per_split=split_at)
    assert backend.plan.num_shared_items >= (1 if split_at == 256 else 2)
    tol = case.tol()
    torch.testing.assert_close(out.float(), case.dense_reference(SCALE), atol=tol, rtol=tol)
    twin_tol = tol if dtype == torch.float32 else 2 * tol
    twin = case.torch_twin(SCALE).float()
    torch.testing.assert_close(out.float(), twin, atol=twin_tol, rtol=twin_tol)
    out_off, off = run_planned(case, min_tokens_per_split=split_at, min_shared_tokens=0)
    assert off.plan.num_shared_items == 0
    torch.testing.assert_close(out.float(), out_off.float(), atol=tol, rtol=tol)
