"""Speculative decoding with a draft model: greedy outputs token-identical to plain decoding
and to transformers (float32, tiny random-weight target; the target itself as its draft, every
draft accepted, and a smaller random draft sharing the vocabulary, nearly every draft
rejected); grammar-aware drafts; pages accounted through chunked prefill, prefix hits,
retraction and aborts mid-draft; a draft with another tokenizer refused; and rejection
sampling keeping the target's distribution (the acceptance rule alone, and through the
executor with a draft distribution q != p)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import torch
from fake_runner import FixedLogits

from radixlm import Engine, SamplingParams
from radixlm.config import EngineConfig
from radixlm.runtime.batch import SampleSlot, ScheduledBatch, ScheduledItem
from radixlm.runtime.core_factory import EngineParts
from radixlm.runtime.errors import ConfigError
from radixlm.runtime.executor import Executor
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.sampler import pick
from radixlm.runtime.sampling_batch import make_generator
from radixlm.runtime.spec.acceptance import rejection_sample

NEW = 24
KW = dict(dtype="float32", page_size=4, num_pages=96, chunked_prefill_size=8, debug_integrity=True)


@pytest.fixture(scope="module")
def small_draft(make_tiny_model) -> Path:
    """Another geometry (1 layer, hidden 32, 1 KV head), the same tokenizer and vocab."""
    return make_tiny_model(
        "llama", 7, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64,
    )  # fmt: skip


def prompts() -> list[list[int]]:
    """Prompts of many lengths (pages of 4, chunks of 8), some repeating spans."""
    base = [17, 305, 1200, 77, 4000, 99, 18, 2500, 611]
    return [base[: 2 + i] * (1 + i % 3) for i in range(7)]


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
            pad_token_id=2,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("which", ["self", "small", "self-lagging"])
def test_greedy_is_token_identical_with_a_draft_model(tiny_llama_dir, small_draft, which):
    """`self-lagging`: no drafting while 3 or more run, so the draft model skips those decode
    steps and catches up later: its own K/V must still be exact (every draft stands)."""
    draft = small_draft if which == "small" else tiny_llama_dir
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    with Engine(str(tiny_llama_dir), **KW) as plain:
        ref = [r.output_token_ids for r in plain.generate(prompts(), params)]
    spec_kw: dict = dict(speculative_algorithm="draft", speculative_draft_model=str(draft))
    if which == "self-lagging":
        spec_kw["speculative_disable_by_batch_size"] = 3
    with Engine(str(tiny_llama_dir), **KW, **spec_kw) as engine:
        first = [r.output_token_ids for r in engine.generate(prompts(), params)]
        again = [r.output_token_ids for r in engine.generate(prompts()[:3], params)]  # prefix hits
        stats = engine.stats()
        engine.check_integrity()
        assert stats.kv_pages_used == 0
    assert first == ref and again == ref[:3]
    assert stats.cache_hit_tokens > 0 and stats.spec_draft_tokens > 0
    if which != "small":  # the target drafting for itself: every draft token stands
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    for p, out in list(zip(prompts(), ref))[:2]:
        assert out == hf_greedy(tiny_llama_dir, p, NEW)


def test_seeded_sampling_with_a_draft_model_is_reproducible(tiny_llama_dir, small_draft):
    """Sampled (n = 2, seeded) through rejection sampling: the same outputs twice; and the
    DSL's in-process `Runtime` takes the same flags."""
    import radixlm as sgl
    from radixlm.lang.backend.runtime import Runtime

    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=5, n=2, ignore_eos=True)
    spec = dict(speculative_algorithm="draft", speculative_draft_model=str(small_draft))
    runs = []
    for _ in range(2):
        with Engine(str(tiny_llama_dir), **KW, **spec) as engine:
            results = engine.generate(prompts()[:3], params)
            runs.append([[o.output_token_ids for o in r.outputs] for r in results])
            assert engine.stats().spec_draft_tokens > 0
    assert runs[0] == runs[1] and all(len(o) == NEW for r in runs[0] for o in r)

    @sgl.function
    def two_turns(s):
        s += "Say something:" + sgl.gen("a", max_tokens=6, temperature=0)
        s += " And again:" + sgl.gen("b", max_tokens=6, temperature=0)

    backend = Runtime(str(tiny_llama_dir), **KW, **spec)
    try:
        state = two_turns.run(backend=backend)
        assert state["a"] and state["b"]
        assert backend.engine.stats().spec_draft_tokens > 0
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def near_draft(make_tiny_model) -> Path:
    """The tiny target's weights (same seed and shapes) under another RMSNorm epsilon: a draft
    whose distribution is close to the target's but not equal."""
    return make_tiny_model(
        "llama", 0, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=0.5
    )


def test_sampling_with_a_draft_model_keeps_the_target_distribution(tiny_llama_dir, near_draft):
    """Top-3 sampling at temperature 1 with a draft close to the target: some draft tokens
    stand (min(1, p/q)), the others are replaced by draws from norm(max(0, p - q)); the
    (first, second) output pairs follow the target's exact distribution (transformers)."""
    from transformers import AutoModelForCausalLM

    prompt = [17, 305, 1200, 77]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)

    def top3(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            values, tokens = model(torch.tensor([ids])).logits[0, -1].topk(3)
        return dict(zip(tokens.tolist(), torch.softmax(values, 0).tolist()))

    exact = {
        (a, b): pa * pb for a, pa in top3(prompt).items() for b, pb in top3([*prompt, a]).items()
    }
    n = 800
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
    spec = dict(speculative_algorithm="draft", speculative_draft_model=str(near_draft))
    kw = dict(KW, num_pages=600, speculative_disable_by_batch_size=1000)  # draft at 64 running
    with Engine(str(tiny_llama_dir), **kw, **spec) as engine:
        results = engine.generate([prompt] * n, params)
        stats = engine.stats()
    counts = Counter(tuple(r.output_token_ids[:2]) for r in results)
    assert set(counts) <= set(exact)
    for pair, prob in exact.items():
        assert abs(counts[pair] / n - prob) < 4 * (prob * (1 - prob) / n) ** 0.5 + 0.005, pair
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_grammar_aware_drafts_give_valid_objects_and_plain_outputs(tiny_llama_dir):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_new_tokens=40, temperature=0, constraint={"json_schema": schema})
    outs = []
    for draft in (None, tiny_llama_dir):
        spec = {"speculative_algorithm": "draft", "speculative_draft_model": str(draft)}
        kw = dict(KW, **spec) if draft else KW
        with Engine(str(tiny_llama_dir), **kw) as engine:
            results = engine.generate(prompts()[:3], params)
            stats = engine.stats()
        for r in results:
            if r.finish_reason == "stop":
                jsonschema.validate(json.loads(r.text), schema)
        outs.append([r.output_token_ids for r in results])
        if draft:
            assert stats.spec_accepted_tokens > 0
    assert outs[0] == outs[1]


def assert_draft_kv_is_the_targets(parts: EngineParts) -> None:
    """With the target as its own draft: at every position the draft model says it computed
    for a running request, its K/V equal the target's (same weights, float32)."""
    draft = parts.executor.proposer
    target_kv, draft_kv = parts.runner.kv_cache, draft.runner.kv_cache
    ps = target_kv.page_size
    for req in parts.scheduler.running:
        slots = [req.pages[p // ps] * ps + p % ps for p in range(draft.written(req))]
        for ours, theirs in zip(draft_kv.k_buffers + draft_kv.v_buffers,
                                target_kv.k_buffers + target_kv.v_buffers):  # fmt: skip
            torch.testing.assert_close(ours[slots], theirs[slots], atol=1e-4, rtol=1e-4)


def test_retraction_and_aborts_mid_draft_leave_no_page_held(tiny_llama_dir, small_draft):
    """A pool too small for all requests forces retractions; one request is aborted while it
    drafts; the others' outputs are plain decoding's and every page comes back. No drafting
    while 4 or more run: the draft model skips those decode steps and catches up later, and
    (drafting for itself) its K/V stay the target's wherever it says it computed them."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    kw = dict(KW, num_pages=30, max_running_requests=8, speculative_disable_by_batch_size=4)
    with Engine(str(tiny_llama_dir), **kw) as plain:
        ref = [r.output_token_ids for r in plain.generate(prompts(), params)]
    for draft in (tiny_llama_dir, small_draft):
        config = EngineConfig.from_kwargs(
            model=str(tiny_llama_dir), speculative_algorithm="draft",
            speculative_draft_model=str(draft), **kw,
        )  # fmt: skip
        parts = EngineParts(config)
        s = parts.scheduler
        reqs = [Request(f"r{i}", p, params) for i, p in enumerate(prompts())]
        for r in reqs:
            parts.appender.init_request(r)
            s.add_request(r)
        victim = None
        while s.has_work():
            parts.core.step()
            if victim is None and s.num_draft_tokens > 0 and s.running:
                victim = s.running[0]  # drafting now (its pages hold a reserved draft's room)
                assert s.abort(victim.request_id) and victim.finish_reason == "abort"
            s.check_integrity()
            if draft == tiny_llama_dir:
                assert_draft_kv_is_the_targets(parts)
        assert victim is not None and s.num_retractions > 0, s.num_retractions
        assert s.pool.num_held == 0
        for i, r in enumerate(reqs):
            if r is not victim:
                assert r.output_token_ids == ref[i], i


def test_the_kv_budget_pays_for_both_pools(tiny_llama_dir, small_draft):
    """With a byte budget, the target's page count is the budget over both pools' bytes per
    page (the draft's pool has the same count); explicit `num_pages` stays as given."""
    budget = 1 << 20
    spec = dict(speculative_algorithm="draft", speculative_draft_model=str(small_draft))
    kw = dict(model=str(tiny_llama_dir), dtype="float32", page_size=4, kv_memory_bytes=budget)
    alone = EngineParts(EngineConfig.from_kwargs(**kw))
    both = EngineParts(EngineConfig.from_kwargs(**kw, **spec))
    target = alone.runner.kv_cache.k_buffers[0]
    draft = both.executor.proposer.runner.kv_cache
    target_bytes = 2 * len(alone.runner.kv_cache.k_buffers) * 4 * target[0].nbytes
    draft_bytes = 2 * len(draft.k_buffers) * 4 * draft.k_buffers[0][0].nbytes
    assert alone.runner.num_pages == budget // target_bytes
    assert both.runner.num_pages == budget // (target_bytes + draft_bytes)
    assert draft.k_buffers[0].shape[0] == 4 * both.runner.num_pages


def test_a_draft_model_that_cannot_draft_is_refused(tiny_llama_dir, make_tiny_model):
    """Another vocabulary size; fewer positions than the target's context; a draft model
    without the algorithm, or the algorithm without one."""
    other = make_tiny_model("llama", 3, vocab_size=49153)
    short = make_tiny_model("llama", 3, max_position_embeddings=64)
    for draft, why in (
        (other, "speculative_draft_model.*vocab_size"),
        (short, "--max-model-len 64"),
    ):
        config = EngineConfig.from_kwargs(
            model=str(tiny_llama_dir), speculative_algorithm="draft",
            speculative_draft_model=str(draft), dtype="float32", num_pages=16,
        )  # fmt: skip
        with pytest.raises(ConfigError, match=why):
            EngineParts(config)
    with pytest.raises(ConfigError, match="speculative_draft_model"):
        EngineConfig.from_kwargs(speculative_algorithm="draft")
    with pytest.raises(ConfigError, match="speculative_draft_model"):
        EngineConfig.from_kwargs(speculative_draft_model=str(other))


class _Tok:
    def __init__(self, vocab: dict[str, int], special: list[int]) -> None:
        self.vocab, self.all_special_ids = vocab, special

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_a_draft_tokenizer_that_differs_is_refused_and_the_flags_parse():
    import argparse

    from radixlm.cli import add_engine_args, engine_kwargs
    from radixlm.runtime.spec.draft_model import check_same_tokenizer

    target = _Tok({"a": 0, "b": 1}, [0])
    check_same_tokenizer(target, _Tok({"a": 0, "b": 1}, [0]), 2, 2, "d")  # the same: fine
    with pytest.raises(ConfigError, match="--speculative-draft-model.*"):
        check_same_tokenizer(target, _Tok({"a": 1, "b": 0}, [0]), 2, 2, "d")
    with pytest.raises(ConfigError, match="special tokens"):
        check_same_tokenizer(target, _Tok({"a": 0, "b": 1}, [1]), 2, 2, "d")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(
        "--speculative-algorithm draft --speculative-draft-model default "
        "--speculative-draft-quantization int4".split()
    )
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.speculative_draft_model == "default"
    assert config.speculative_draft_quantization == "int4"
    assert config.scheduler.speculative_algorithm == "draft"


def test_rejection_sample_keeps_the_target_distribution():
    """Drafts drawn from q (!= p): the first emitted token is distributed as p[0]; given the
    first draft token stood, the second as p[1]; the first stands with probability
    sum(min(p0, q0)) (the identity rule would accept with sum(p0 * q0))."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 5, generator=g) * 1.5, -1)  # [k + 1, V]
    q = torch.softmax(torch.randn(2, 5, generator=g) * 1.5, -1)  # [k, V]
    first, second, n, stood = Counter(), Counter(), 20000, 0
    for _ in range(n):
        u = torch.rand(4, generator=g)
        draft = pick(q, u[:2]).tolist()
        a, tok = rejection_sample(p, q, draft, torch.rand(3, generator=g))
        run = [*draft[:a], tok]
        first[run[0]] += 1
        if a >= 1:
            stood += 1
            second[run[1]] += 1
    for counts, row in ((first, p[0]), (second, p[1])):
        total = sum(counts.values())
        for t in range(5):
            assert abs(counts[t] / total - float(row[t])) < 0.02, (t, counts, row)
    assert abs(stood / n - float(torch.minimum(p[0], q[0]).sum())) < 0.015


class FixedDraft:
    """A proposer whose draft is 2 tokens drawn from a fixed q (as a draft model would)."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q  # [V]
        self.gen = make_generator(7)

    def propose(self, batch, grammar):  # type: ignore[no-untyped-def]
        item = batch.items[0]
        item.draft = torch.multinomial(self.q, 2, replacement=True, generator=self.gen).tolist()
        item.num_tokens += 2
        return {0: self.q.expand(2, -1)}


def test_the_executor_verifies_a_sampled_draft_by_rejection_sampling():
    logits = torch.tensor([1.0, 2.0, 0.5, 1.5])
    p = torch.softmax(logits, 0)
    q = torch.tensor([0.55, 0.05, 0.3, 0.1])
    ex = Executor(FixedLogits(logits), eos_token_ids=[], seed=123, proposer=FixedDraft(q))
    first, second, stood, n = Counter(), Counter(), 0, 4000
    for i in range(n):
        req = Request(f"q{i}", [0, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=8))
        req.token_ids.append(3)  # one output token so far, not computed yet
        req.num_computed_tokens = 3
        req.status = RequestStatus.RUNNING
        req.pages = [0, 1]
        item = ScheduledItem(req, 1, draft_limit=2)
        out = ex.run(ScheduledBatch([item], samples=[SampleSlot(req, 0)]))
        accepted = out.accepted[0][0]
        assert accepted == item.draft[: len(accepted)]
        run_ = [*accepted, out.token_ids[0]]
        first[run_[0]] += 1
        stood += bool(accepted)
        if accepted:
            second[run_[1]] += 1
    for counts in (first, second):
        total = sum(counts.values())
        for t in range(4):
            assert abs(counts[t] / total - float(p[t])) < 0.035, (t, counts, p)
    assert abs(stood / n - float(torch.minimum(p, q).sum())) < 0.03
