"""Scheduler with a fake runner: budgets, chunking, LPM + aging, retraction, n>1, abort."""

from __future__ import annotations

import random

import pytest
from fake_runner import EOS, FakeRunner, attach_core, reference_continuation

from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.batch import StepResult
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduler, TokenAppender


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(
    num_pages: int = 64,
    page_size: int = 4,
    caching: bool = True,
    max_model_len: int = 4096,
    clock: Clock | None = None,
    **cfg,
) -> Scheduler:
    runner = FakeRunner(num_pages, page_size)
    pool = BlockPool(num_pages, page_size)
    cache = RadixCache(pool, enabled=caching)
    appender = TokenAppender(None, [EOS], max_model_len)
    config = SchedulerConfig(**cfg)
    s = Scheduler(
        pool, cache, config, appender, max_model_len, clock=clock or Clock(), debug_integrity=True
    )
    return attach_core(s, runner)


def req(rid: str, prompt: list[int], n_out: int, arrival: float = 0.0, **params) -> Request:
    p = SamplingParams(max_new_tokens=n_out, temperature=0, **params)
    return Request(rid, prompt, p, arrival_time=arrival)


def run(s: Scheduler, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not s.has_work():
            return
        s.step()
    raise AssertionError("scheduler did not finish")


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 60) for _ in range(n)]


def assert_all_released(s: Scheduler) -> None:
    s.check_integrity()
    assert s.pool.num_held == 0
    assert s.pool.num_free + s.pool.num_cached == s.pool.num_pages


@pytest.mark.parametrize("chunk", [None, 8, 32])
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_match_reference_under_any_batching(chunk, caching):
    rng = random.Random(0)
    s = make(
        chunked_prefill_size=chunk, max_batched_tokens=48, max_running_requests=6, caching=caching
    )
    reqs = [req(f"r{i}", prompt(rng, rng.randint(1, 40)), rng.randint(1, 12)) for i in range(20)]
    for r in reqs:
        s.add_request(r)
    run(s)
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_token_ids == reference_continuation(
            r.prompt_token_ids, r.params.max_new_tokens
        )
    assert_all_released(s)


def test_token_budget_and_running_limit_respected():
    rng = random.Random(1)
    s = make(chunked_prefill_size=16, max_batched_tokens=20, max_running_requests=3)
    for i in range(10):
        s.add_request(req(f"r{i}", prompt(rng, 30), 5))
    while s.has_work():
        s.step()
        assert len(s.running) <= 3
    assert s.runner.batches
    assert all(b.num_tokens <= 20 for b in s.runner.batches)
    assert max(b.num_tokens for b in s.runner.batches) == 20  # the budget is actually used


def test_chunked_prefill_splits_a_long_prompt_and_mixes_with_decodes():
    rng = random.Random(2)
    s = make(chunked_prefill_size=8, max_batched_tokens=64)
    short = req("short", prompt(rng, 3), 10)
    s.add_request(short)
    s.step()  # short prefilled, now decoding
    long = req("long", prompt(rng, 30), 2)
    s.add_request(long)
    s.step()
    b = s.runner.batches[-1]
    assert b.extend_lens_cpu == [1, 8]  # one decode + one prefill chunk in a single forward
    run(s)
    chunks = [b.extend_lens_cpu[-1] for b in s.runner.batches[1:5]]
    assert chunks == [8, 8, 8, 6]
    assert long.output_token_ids == reference_continuation(long.prompt_token_ids, 2)
    assert_all_released(s)


def test_max_prefill_tokens_bounds_a_steps_prefill_and_keeps_outputs_exact():
    rng = random.Random(5)
    s = make(chunked_prefill_size=8, max_batched_tokens=48, max_prefill_tokens=12)
    reqs = [req(f"r{i}", prompt(rng, rng.randint(2, 40)), rng.randint(1, 8)) for i in range(12)]
    for r in reqs:
        s.add_request(r)
    run(s)
    for b in s.runner.batches:
        assert sum(n for n in b.extend_lens_cpu if n > 1) <= 12
    assert max(sum(n for n in b.extend_lens_cpu if n > 1) for b in s.runner.batches) == 12
    for r in reqs:
        assert r.output_token_ids == reference_continuation(
            r.prompt_token_ids, len(r.output_token_ids)
        )
    assert_all_released(s)


@pytest.mark.parametrize("cap", [None, 12])
def test_max_prefill_tokens_serves_the_shortest_remaining_prefill_first(cap):
    rng = random.Random(6)
    s = make(chunked_prefill_size=8, max_batched_tokens=64, max_prefill_tokens=cap)
    long, short = req("long", prompt(rng, 30), 2), req("short", prompt(rng, 10), 2)
    s.add_request(long)
    s.add_request(short)
    s.step()
    assert s.runner.batches[0].extend_lens_cpu == ([8, 4] if cap else [8, 8])
    s.step()
    # with the cap, the short prompt (6 left) goes first and gets its first token now
    assert s.runner.batches[1].extend_lens_cpu == ([6, 6] if cap else [8, 2])
    assert short.num_output_tokens == 1
    run(s)
    assert_all_released(s)


@pytest.mark.parametrize("cap", [None, 12])
def test_a_prompt_finishing_this_step_goes_before_a_running_long_one(cap):
    """A returning turn (short remaining prompt) arriving while a long prompt is prefilled."""
    rng = random.Random(7)
    s = make(chunked_prefill_size=8, max_batched_tokens=64, max_prefill_tokens=cap)
    long, short = req("long", prompt(rng, 40), 2), req("short", prompt(rng, 6), 2)
    s.add_request(long)
    s.step()
    s.add_request(short)
    s.step()
    # capped: the short prompt is computed whole now, the long one gets what is left
    assert s.runner.batches[1].extend_lens_cpu == ([6, 6] if cap else [8, 6])
    assert short.num_output_tokens == 1
    run(s)
    assert long.output_token_ids == reference_continuation(long.prompt_token_ids, 2)
    assert_all_released(s)


def test_a_stream_of_short_prompts_does_not_starve_a_running_long_one():
    rng = random.Random(8)
    s = make(chunked_prefill_size=8, max_batched_tokens=64, max_prefill_tokens=8)
    long = req("long", prompt(rng, 64), 1)
    s.add_request(long)
    s.step()
    for i in range(20):
        s.add_request(req(f"s{i}", prompt(rng, 8), 1))  # each fills a whole step
        s.step()
        if long.is_finished:
            break
    # the long prompt gets the budget at least every other step: 56 tokens in <= 14 steps
    assert long.is_finished and i <= 14
    run(s)
    assert_all_released(s)


def test_no_chunking_runs_a_long_prompt_whole_when_alone():
    rng = random.Random(3)
    s = make(chunked_prefill_size=None, max_batched_tokens=16)
    r = req("big", prompt(rng, 50), 3)
    s.add_request(r)
    s.step()
    assert s.runner.batches[0].extend_lens_cpu == [50]
    run(s)
    assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 3)


def test_lpm_prefers_longest_cached_prefix_and_aging_prevents_starvation():
    rng = random.Random(4)
    shared = prompt(rng, 24)
    clock = Clock()
    s = make(schedule_policy="lpm", max_running_requests=1, aging_tokens_per_second=10, clock=clock)
    warm = req("warm", shared + [5], 1)
    s.add_request(warm)
    run(s)
    cold = req("cold", prompt(rng, 20), 1, arrival=0.0)
    hot = req("hot", shared + [7, 8], 1, arrival=0.5)
    s.add_request(cold)
    s.add_request(hot)
    s.step()
    assert s.running == [] or s.running[0] is hot or hot.is_finished
    assert hot.num_cached_tokens == 24
    run(s)
    # Aging: the cold request has waited long enough to beat a fresh full hit.
    cold2 = req("cold2", prompt(rng, 20), 1, arrival=0.0)
    hot2 = req("hot2", shared + [9, 9], 1, arrival=9.9)
    clock.t = 10.0  # cold2 waited 10 s -> 100 tokens of aging; hot2's 24-token hit + 1 token
    s.add_request(hot2)
    s.add_request(cold2)
    s.step()
    assert cold2.admitted_once and not hot2.admitted_once


def test_fcfs_keeps_arrival_order():
    rng = random.Random(5)
    shared = prompt(rng, 16)
    s = make(schedule_policy="fcfs", max_running_requests=1)
    s.add_request(req("warm", shared + [1], 1))
    run(s)
    a = req("a", prompt(rng, 10), 1)
    b = req("b", shared + [4], 1)
    s.add_request(a)
    s.add_request(b)
    s.step()
    assert a.admitted_once and not b.admitted_once


def test_retraction_under_memory_pressure_keeps_outputs_exact():
    rng = random.Random(6)
    # 24 pages of 4 tokens = 96 token slots for 8 requests that grow to 10 + 30 tokens each.
    s = make(num_pages=24, page_size=4, chunked_prefill_size=16, max_batched_tokens=64)
    reqs = [req(f"r{i}", prompt(rng, 10), 30) for i in range(8)]
    for r in reqs:
        s.add_request(r)
    run(s)
    assert s.num_retractions > 0
    for r in reqs:
        assert r.finish_reason == "length", r.error
        assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 30)
    assert_all_released(s)


def test_retracted_request_recomputes_from_radix_cache():
    rng = random.Random(7)
    s = make(num_pages=16, page_size=4, chunked_prefill_size=64, max_batched_tokens=128)
    reqs = [req(f"r{i}", prompt(rng, 16), 20) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    run(s)
    assert s.num_retractions > 0
    assert s.cache.stats().hit_tokens > 0  # re-admissions hit the pages cached at retraction
    assert_all_released(s)


def test_request_alone_exceeding_memory_fails_clearly_and_others_proceed():
    rng = random.Random(8)
    s = make(num_pages=4, page_size=4, chunked_prefill_size=8)
    hog = req("hog", prompt(rng, 10), 100)
    small = req("small", prompt(rng, 3), 2)
    s.add_request(hog)
    s.add_request(small)
    run(s)
    assert hog.finish_reason == "error"
    assert "KV cache" in hog.error
    assert small.finish_reason == "length"
    assert small.output_token_ids == reference_continuation(small.prompt_token_ids, 2)
    assert_all_released(s)


def test_prompt_larger_than_pool_fails_without_deadlock():
    rng = random.Random(9)
    s = make(num_pages=4, page_size=4, chunked_prefill_size=None, max_batched_tokens=64)
    r = req("huge", prompt(rng, 40), 1)
    s.add_request(r)
    run(s, max_steps=10)
    assert r.finish_reason == "error"
    assert_all_released(s)


def test_n_branches_share_prompt_pages_and_copy_the_partial_page():
    rng = random.Random(10)
    s = make(page_size=4)
    p = prompt(rng, 10)  # 2 full pages + a partial page of 2 tokens
    parent = req("g", p, 6, n=3)
    s.add_request(parent)
    s.step()  # prefill + fork
    branches = [r for r in s.running if r.request_id == "g"]
    assert len(branches) == 3
    full = parent.pages[:2]
    for b in branches:
        assert b.pages[:2] == full
    assert all(s.pool.ref(pg) == 3 for pg in full)
    partial = {b.pages[2] for b in branches}
    assert len(partial) == 3  # each branch owns a private copy of the partial page
    run(s)
    assert s.total_computed_prompt_tokens == 10  # the prompt was computed once
    expected = reference_continuation(p, 6)
    for b in branches:
        assert b.output_token_ids == expected
    assert_all_released(s)


def test_abort_frees_pages_waiting_and_running():
    rng = random.Random(11)
    s = make(max_running_requests=1)
    a = req("a", prompt(rng, 12), 50)
    b = req("b", prompt(rng, 12), 50)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        s.step()
    assert a.status is RequestStatus.RUNNING and a.pages
    done = s.abort("a") + s.abort("b")
    assert [r.request_id for r in done] == ["a", "b"]
    s.processor.emit(StepResult.finished(done))
    assert a.finish_reason == "abort" and b.finish_reason == "abort"
    assert not s.has_work()
    assert_all_released(s)
    assert not s.abort("missing")


def test_prefix_hit_skips_computed_pages_and_reports_cached_tokens():
    rng = random.Random(12)
    s = make(page_size=4)
    shared = prompt(rng, 21)
    first = req("first", shared + [3], 4)
    s.add_request(first)
    run(s)
    second = req("second", shared + [4, 5], 4)
    s.add_request(second)
    s.step()
    assert second.num_cached_tokens == 20  # 5 full pages of the shared 21 tokens
    assert s.runner.batches[-1].extend_lens_cpu == [3]
    run(s)
    assert second.output_token_ids == reference_continuation(second.prompt_token_ids, 4)


def test_concurrent_arrivals_share_a_prompt_once_prefilled():
    rng = random.Random(13)
    s = make(page_size=4, chunked_prefill_size=8, max_batched_tokens=8)
    shared = prompt(rng, 16)
    a = req("a", shared + [1], 2)
    s.add_request(a)
    s.step()
    s.step()  # a's prompt is 17 tokens: 2 steps of 8 then 1
    b = req("b", shared + [2], 2)
    s.add_request(b)
    run(s)
    assert b.num_cached_tokens == 16  # a's full prompt pages were cached as soon as computed


def test_stop_token_and_max_len():
    rng = random.Random(14)
    p = prompt(rng, 5)
    cont = reference_continuation(p, 5)
    s = make(max_model_len=len(p) + 3)
    r1 = req("stoptok", p, 10, stop_token_ids=[cont[1]])
    r2 = req("maxlen", p, 10)
    s.add_request(r1)
    s.add_request(r2)
    run(s)
    assert r1.finish_reason == "stop" and r1.stop_reason == cont[1]
    assert r1.output_token_ids == cont[:2]
    assert r2.finish_reason == "length" and len(r2.output_token_ids) == 3


def test_in_batch_prefix_sharing_defers_followers_until_the_leader_is_cached():
    rng = random.Random(15)
    s = make(page_size=4, chunked_prefill_size=16, max_batched_tokens=64)
    system = prompt(rng, 64)
    reqs = [req(f"c{i}", system + prompt(rng, 5), 3) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    run(s)
    assert all(r.num_cached_tokens == 64 for r in reqs[1:])
    assert s.total_computed_prompt_tokens == 69 + 5 * 5  # the system prompt computed once
    for r in reqs:
        assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 3)


def test_unforked_branches_finish_with_their_failed_or_aborted_parent():
    rng = random.Random(16)
    s = make(num_pages=4, page_size=4, chunked_prefill_size=None)
    big = req("big", prompt(rng, 40), 2, n=3)
    outs: list = []
    big.sink = outs.append
    s.add_request(big)
    run(s, max_steps=5)
    s2 = make()
    waiting = req("w", prompt(rng, 8), 2, n=2)
    outs2: list = []
    waiting.sink = outs2.append
    s2.add_request(waiting)
    s2.processor.emit(StepResult.finished(s2.abort("w")))
    for got, n, reason in ((outs, 3, "error"), (outs2, 2, "abort")):
        finished = [o for o in got if o.finished]
        assert sorted(o.index for o in finished) == list(range(n))
        assert all(o.finish_reason == reason for o in finished)


@pytest.mark.parametrize("chunk", [None, 4, 16])
def test_prompt_logprobs_from_position_k_even_with_a_cached_prefix(chunk):
    import math

    from fake_runner import VOCAB, reference_next

    rng = random.Random(17)
    s = make(page_size=4, chunked_prefill_size=chunk, max_batched_tokens=64)
    shared = prompt(rng, 16)
    s.add_request(req("warm", shared + [3], 1))
    run(s)
    p = shared + prompt(rng, 6)
    r = req("lp", p, 2, logprob_start_len=10)
    s.add_request(r)
    run(s)
    hit = 10.0 - math.log(math.exp(10.0) + VOCAB - 1)
    miss = -math.log(math.exp(10.0) + VOCAB - 1)
    expected = [hit if reference_next(p[:i]) == p[i] else miss for i in range(10, len(p))]
    assert r.prompt_logprobs == pytest.approx(expected, abs=1e-5)
    assert 0 < r.num_cached_tokens <= 8  # the prefix before position 9 may still come from cache
    assert r.output_token_ids == reference_continuation(p, 2)
    r0 = req("lp0", p, 1, logprob_start_len=0)
    s.add_request(r0)
    run(s)
    assert r0.prompt_logprobs[0] is None and len(r0.prompt_logprobs) == len(p)
    assert r0.prompt_logprobs[10:] == pytest.approx(expected, abs=1e-5)


def test_prompt_logprobs_of_a_one_token_prompt():
    s = make()
    r = req("one", [7], 1, logprob_start_len=0)
    s.add_request(r)
    run(s)
    assert r.prompt_logprobs == [None]


@pytest.mark.parametrize("chunk", [None, 4])
def test_prompt_top_logprobs_match_the_prompt_logprobs(chunk):
    """With top_logprobs, every prompt position from logprob_start_len has its top pairs: the
    fake model's next token first (logit 10), then the rest (all equal)."""
    from fake_runner import reference_next

    rng = random.Random(5)
    s = make(page_size=4, chunked_prefill_size=chunk, max_batched_tokens=64)
    p = prompt(rng, 14)
    r = req("top", p, 1, logprob_start_len=3, top_logprobs=2)
    s.add_request(r)
    run(s)
    tops = r.prompt_top_logprobs
    assert tops is not None and len(tops) == len(r.prompt_logprobs) == len(p) - 3
    for i, (lp, top) in enumerate(zip(r.prompt_logprobs, tops)):
        pos = 3 + i
        assert len(top) == 2 and top[0][1] >= top[1][1]
        assert top[0][0] == reference_next(p[:pos])
        assert top[0][1] == pytest.approx(max(lp, top[0][1]), abs=1e-5)
        if p[pos] == top[0][0]:
            assert lp == pytest.approx(top[0][1], abs=1e-5)
    assert req("off", p, 1, logprob_start_len=3).prompt_top_logprobs is None


BAD = 59  # a prompt holding this token makes the cache's prefix match raise in the test below


@pytest.mark.parametrize("where", ["match_prefix", "ensure_pages", "policy"])
def test_an_exception_while_scheduling_one_request_fails_only_that_request(where, monkeypatch):
    """Admission (prefix match), page growth of a running request, or the policy's ordering
    raising for one request: that request fails with the reason, the others finish with
    their reference outputs, no page leaks (a policy failure fails nobody: FIFO instead)."""
    rng = random.Random(3)
    s = make(max_batched_tokens=64, max_running_requests=8, num_pages=64)
    good = [req(f"g{i}", prompt(rng, 12), 6) for i in range(4)]
    bad = req("bad", [*prompt(rng, 6), BAD, *prompt(rng, 5)], 6)
    if where == "match_prefix":
        real = s.cache.match_prefix

        def match_prefix(tokens, namespace=None):  # type: ignore[no-untyped-def]
            if BAD in tokens:
                raise RuntimeError("injected match fault")
            return real(tokens, namespace)

        monkeypatch.setattr(s.cache, "match_prefix", match_prefix)
    elif where == "ensure_pages":
        real_grow = s.pages.try_grow

        def grow(r, total):  # type: ignore[no-untyped-def]
            if r is bad:
                raise RuntimeError("injected page fault")
            return real_grow(r, total)

        monkeypatch.setattr(s.pages, "try_grow", grow)
    else:
        calls = {"n": 0}
        real_order = s.policy.order

        def order(waiting):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected policy fault")
            return real_order(waiting)

        monkeypatch.setattr(s.policy, "order", order)
    for r in [good[0], good[1], bad, good[2], good[3]]:
        s.add_request(r)
    run(s)
    for r in good:
        assert r.finish_reason == "length", r.error
        assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 6)
    if where == "policy":
        assert bad.finish_reason == "length"
    else:
        assert bad.finish_reason == "error"
        assert "internal error while scheduling this request" in bad.error
        assert "injected" in bad.error
    assert_all_released(s)


def test_a_fault_while_forking_fails_only_that_group(monkeypatch):
    """Forking n > 1 branches raising (after one branch took a page): the parent and its
    branches fail with the reason, through the step's outputs; the others run on; no leak."""
    import radixlm.runtime.scheduler.forks as forks

    rng = random.Random(21)
    s = make(page_size=4)
    group = req("g", prompt(rng, 10), 4, n=3)
    other = req("o", prompt(rng, 9), 4)
    outs: list = []
    group.sink = outs.append
    real = forks.make_branch

    def make_branch(parent, index, init):  # type: ignore[no-untyped-def]
        if index == 2:
            raise RuntimeError("injected fork fault")
        return real(parent, index, init)

    monkeypatch.setattr(forks, "make_branch", make_branch)
    s.add_request(group)
    s.add_request(other)
    run(s)
    finished = sorted((o.index, o.finish_reason) for o in outs if o.finished)
    assert finished == [(0, "error"), (1, "error"), (2, "error")]
    assert "injected fork fault" in group.error
    assert other.finish_reason == "length"
    assert other.output_token_ids == reference_continuation(other.prompt_token_ids, 4)
    assert_all_released(s)
