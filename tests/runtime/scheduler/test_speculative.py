"""Speculative decoding with prompt-lookup drafts: the drafter alone; greedy outputs identical
to plain decoding on the fake runner (whose next token is computed from the context read back
from the paged KV cache, so a rejected draft's K/V left standing would change the output); and
the sampled distribution unchanged (rejection sampling), measured on fixed logits."""

from __future__ import annotations

import random
from collections import Counter

import fake_runner
import pytest
import torch
from fake_runner import EOS, FakeRunner, FixedLogits, attach_core, reference_continuation

from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.batch import SampleSlot, ScheduledBatch, ScheduledItem
from radixlm.runtime.errors import ConfigError
from radixlm.runtime.executor import Executor
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduler, TokenAppender
from radixlm.runtime.scheduler.drafter import Drafter, Proposal, first_token_keys
from radixlm.runtime.spec.gain import StepCost


class FormulaCost(StepCost):
    """A step cost by formula: the fake runner's step times mean nothing."""

    def __init__(self, f) -> None:
        super().__init__()
        self.f = f

    def record(self, rows: int, seconds: float) -> None:
        pass

    def cost(self, rows: int) -> float:
        return self.f(rows)


def test_the_drafter_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    d = Drafter(None, ngram_min=1, ngram_max=3)
    r = Request("a", [5, 6, 7, 8, 9, 5, 6, 7], SamplingParams())
    assert d.propose(r, 3) == Proposal([8, 9, 5], "ngram3")  # "5 6 7" occurred at 0..2
    r.token_ids += [1, 2]  # "7 1 2": only the 1-gram "2" could match, and it did not occur
    assert d.propose(r, 3) is None
    r.token_ids += [6, 7]  # "2 6 7" no; "6 7" yes (went on with 8, then 1): latest, at 7
    assert d.propose(r, 2) == Proposal([1, 2], "ngram2~")
    assert Drafter(None, 2, 2).propose(Request("b", [3, 3], SamplingParams()), 4) is None


def test_a_copied_span_matches_without_its_leading_space():
    """JSON extraction: the prompt says ' New York City.' (tokens 10 11 12 13); the output
    writes '":"' (20) then 'New' (30, the space-less twin of 10). Keyed without the leading
    space, the 1-gram 'New' finds ' New' and drafts ' York City .'; a 2-gram match still wins
    over it, and without the keys nothing matches."""
    prompt = [1, 2, 10, 11, 12, 13, 3]
    vocab = [None] * 31
    vocab[10:14], vocab[20], vocab[30] = [b" New", b" York", b" City", b"."], b'":"', b"New"
    keys = first_token_keys(vocab)
    assert keys == {10: 30}
    r = Request("x", [*prompt, 20, 30], SamplingParams())
    assert Drafter(None, 1, 3, keys).propose(r, 4) == Proposal([11, 12, 13, 3], "ngram1")
    assert Drafter(None, 1, 3).propose(Request("y", [*prompt, 20, 30], SamplingParams()), 4) is None
    # Only the first token of an n-gram drops its space: ' York' never matches 'York'.
    r2 = Request("z", [*prompt, 20, 30, 11], SamplingParams())
    assert Drafter(None, 1, 3, {10: 30, 11: 31}).propose(r2, 2) == Proposal([12, 13], "ngram2")


def test_the_radix_tree_drafts_first():
    pool = BlockPool(8, 4)
    cache = RadixCache(pool)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    cache.insert(seq, pool.alloc(3))
    d = Drafter(cache, 1, 3)
    assert d.propose(Request("a", seq[:6], SamplingParams()), 3) == Proposal([7, 8, 9], "tree")
    # Not held by the tree: prompt lookup ("1 2 3" -> 4).
    assert d.propose(Request("b", [5, 1, 2, 3, 7, 1, 2, 3], SamplingParams()), 1) == Proposal(
        [7], "ngram3"
    )


def test_acceptance_is_learned_per_request_and_source():
    d = Drafter(None, 1, 3)
    a, b = Request("a", [1, 2, 1, 2, 1], SamplingParams()), Request("b", [9], SamplingParams())
    assert d.alpha(a, "ngram1") == 0.5  # nothing verified: the prior
    assert d.propose(a, 4).source == "ngram3"
    for _ in range(5):
        d.record(a, 4, 4)  # "ngram3" drafts of `a` all stand
    assert d.alpha(a, "ngram3") > 0.9
    assert 0.5 < d.alpha(b, "ngram3") < d.alpha(a, "ngram3")  # the global prior moved too
    assert d.alpha(a, "ngram1") == 0.5  # another source: untouched
    c = Request("c", [4, 5, 6, 4], SamplingParams())
    assert d.propose(c, 2).source == "ngram1"
    for _ in range(5):
        d.record(c, 2, 0)  # ... never stands
    assert d.alpha(c, "ngram1") < 0.2 and d.alpha(a, "ngram1") < 0.5


def test_planned_drafts_calibrate_the_model():
    """A draft sized by `plan` counts its expected accepted tokens (at the estimate it was
    planned with) against what stood; a draft `plan` did not size does not count."""
    d = Drafter(None, 1, 3)
    a = Request("a", [1, 2, 1, 2, 1], SamplingParams())
    d.cost.record(1, 0.01)
    d.cost.record(5, 0.01)  # flat: every draft token is free
    assert d.propose(a, 4).source == "ngram3"
    assert d.plan([(a, "ngram3", 4)], 1, 1) == [4]  # planned at alpha 0.5
    d.record(a, 4, 0)  # expected 0.9375 tokens, none stood
    assert d.calibration.expected == pytest.approx(0.9375) and d.calibration.realized == 0
    assert d.calibration.scale() < 1
    d.record(a, 4, 4)  # not planned since: the acceptance counts move, the calibration not
    assert d.calibration.expected == pytest.approx(0.9375) and d.calibration.realized == 0


def make(speculative: bool, num_pages: int = 64, cost=lambda rows: 1.0, **cfg) -> Scheduler:
    runner = FakeRunner(num_pages, 4)
    pool = BlockPool(num_pages, 4)
    if speculative:
        cfg.update(speculative_algorithm="ngram", speculative_ngram_min=1)
    config = SchedulerConfig(**cfg)
    s = Scheduler(
        pool, RadixCache(pool), config, TokenAppender(None, [EOS], 4096), 4096,
        debug_integrity=True,
    )  # fmt: skip
    if s.drafter is not None:
        s.drafter.cost = FormulaCost(cost)
    return attach_core(s, runner)


def run(s: Scheduler, reqs: list[Request]) -> int:
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.has_work():
        s.step()
        steps += 1
        assert steps < 5000
    s.check_integrity()
    assert s.pool.num_held == 0
    return steps


def requests(seed: int, n: int = 12, out: int = 24) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            [rng.randrange(3, 60) for _ in range(rng.randint(3, 30))],
            SamplingParams(max_new_tokens=out, temperature=0),
        )
        for i in range(n)
    ]


@pytest.fixture
def periodic(monkeypatch):
    """A fake model that repeats the context with period 5: drafts are right once it cycles."""
    monkeypatch.setattr(fake_runner, "reference_next", lambda ctx: ctx[-5] if len(ctx) >= 5 else 3)


@pytest.mark.parametrize("cfg", [{}, {"chunked_prefill_size": 8}, {"num_pages": 24}])
def test_greedy_outputs_equal_plain_decoding_and_drafts_are_accepted(periodic, cfg):
    plain, spec = make(False, **cfg), make(True, **cfg)
    a, b = requests(1), requests(1)
    steps_plain, steps_spec = run(plain, a), run(spec, b)
    for x, y in zip(a, b):
        assert y.output_token_ids == x.output_token_ids
        assert y.output_token_ids == reference_continuation(y.prompt_token_ids, 24)
        assert y.finish_reason == "length"
    assert spec.num_accepted_draft_tokens > 0
    assert steps_spec < steps_plain
    if "num_pages" in cfg:
        assert spec.num_retractions > 0


def test_rejected_drafts_leave_no_trace():
    """The sum-based fake model almost never repeats: nearly every draft is rejected, and
    the outputs are still the reference."""
    s = make(True)
    reqs = requests(2, out=40)
    run(s, reqs)
    for r in reqs:
        assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 40)
    assert s.num_draft_tokens > s.num_accepted_draft_tokens


def test_a_stop_token_inside_an_accepted_run_cuts_it(periodic):
    s = make(True)
    prompt = [10, 11, 12, 13, 14] * 2
    r = Request("s", prompt, SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=[13]))
    run(s, [r])
    assert r.output_token_ids == [10, 11, 12, 13] and r.finish_reason == "stop"


def test_rejection_sampling_keeps_the_target_distribution():
    """Draft [1, 1] against p: the first emitted token is distributed as p (whatever the
    draft), the second as p too (given the first was accepted)."""
    logits = torch.tensor([1.0, 2.0, 0.5, 1.5])
    p = torch.softmax(logits, 0)
    ex = Executor(FixedLogits(logits), eos_token_ids=[], seed=123)
    first, second = Counter(), Counter()
    n = 6000
    for i in range(n):
        req = Request(f"q{i}", [0, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=8))
        req.token_ids.append(3)  # one output token so far, not computed yet
        req.num_computed_tokens = 3
        req.status = RequestStatus.RUNNING
        req.pages = [0]
        batch = ScheduledBatch([ScheduledItem(req, 3, [1, 1])], samples=[SampleSlot(req, 0)])
        out = ex.run(batch)
        run_ = [*out.accepted[0][0], out.token_ids[0]]
        first[run_[0]] += 1
        if len(run_) > 1:
            second[run_[1]] += 1
    for counts in (first, second):
        total = sum(counts.values())
        for t in range(4):
            assert abs(counts[t] / total - float(p[t])) < 0.03, (t, counts, p)


def test_a_repeated_request_drafts_its_earlier_run_from_the_radix_tree():
    """The sum-based fake model never repeats itself, so prompt lookup finds nothing; a second
    run of the same prompt drafts the first run's cached output and accepts it."""
    s = make(True)
    first = requests(3, n=1, out=40)
    steps_first = run(s, first)
    accepted = s.num_accepted_draft_tokens
    again = requests(3, n=1, out=40)
    steps_again = run(s, again)
    assert again[0].output_token_ids == first[0].output_token_ids
    assert s.num_accepted_draft_tokens - accepted >= 30  # 40 outputs, cached in whole pages
    assert steps_again <= 2 + 40 // 5 + 2  # prefill, then 5 tokens per step (4 drafted)
    assert steps_again < steps_first


def test_draft_length_adapts_and_large_batches_do_not_draft(periodic):
    d = Drafter(None, 1, 3)
    r = Request("a", [1, 2, 3, 1, 2], SamplingParams())
    assert d.propose(r, 4) == Proposal([3, 1, 2], "ngram2") and d.draft_length(r, 4) == 4
    d.record(r, 4, 0)
    d.record(r, 4, 0)
    assert d.draft_length(r, 4) == 1  # nothing accepted lately: one token
    d.record(r, 1, 1)
    d.record(r, 2, 2)
    assert d.draft_length(r, 4) == 2  # mean accepted ~1.25: two tokens
    s = make(True, speculative_disable_by_batch_size=4)
    reqs = requests(1, n=8)
    run(s, reqs)
    for r in reqs:
        assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 24)
    assert s.num_draft_tokens > 0  # drafted once fewer than 4 were left running
    none = make(True, speculative_disable_by_batch_size=1)
    run(none, requests(1, n=2))
    assert none.num_draft_tokens == 0


def test_n_branches_and_aborts_with_drafting(periodic):
    """n > 1 branches draft independently and match plain decoding; an abort mid-draft leaves
    no page held."""
    plain, spec = make(False), make(True)
    outs = []
    for s in (plain, spec):
        deltas: list = []
        group = Request(
            "g", [7, 8, 9, 10, 11] * 2, SamplingParams(max_new_tokens=20, temperature=0, n=3),
            sink=deltas.append,
        )  # fmt: skip
        run(s, [group])
        tokens: dict[int, list[int]] = {}
        for d in deltas:
            tokens.setdefault(d.index, []).extend(d.token_ids)
        outs.append(tokens)
    assert sorted(outs[0]) == [0, 1, 2] and outs[0] == outs[1]
    assert all(len(t) == 20 for t in outs[1].values())
    s = make(True, speculative_num_draft_tokens=4)  # short drafts: r1, r2 still run at step 6
    reqs = requests(4, n=4, out=30)
    for r in reqs:
        s.add_request(r)
    for _ in range(6):
        s.step()
    assert s.num_draft_tokens > 0
    done = s.abort("r1") + s.abort("r2")
    assert {r.request_id for r in done} == {"r1", "r2"}
    while s.has_work():
        s.step()
    s.check_integrity()
    assert s.pool.num_held == 0
    for r in (reqs[0], reqs[3]):
        assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 30)


def test_drafts_are_sized_by_the_step_cost(periodic):
    """A forward flat up to 8 rows and linear past them: alone, a request's drafts ride free
    and are verified; while 8 run every draft row would cost a full token's share of the step,
    so none is (once fewer run, the rows left free are drafted). Outputs are the reference."""

    def knee(rows: int) -> float:
        return max(8.0, float(rows))

    one = make(True, cost=knee)
    a = requests(1, n=1)
    run(one, a)
    assert one.num_accepted_draft_tokens > 0
    eight = make(True, cost=knee)
    b = requests(1, n=8)
    for r in b:
        eight.add_request(r)
    drafted_at: dict[int, int] = {}  # running requests -> draft tokens verified
    while eight.has_work():
        n, before = len(eight.running), eight.num_draft_tokens
        eight.step()
        drafted_at[n] = drafted_at.get(n, 0) + eight.num_draft_tokens - before
    assert drafted_at[8] == 0 and eight.num_draft_tokens > 0
    for r in a + b:
        assert r.output_token_ids == reference_continuation(r.prompt_token_ids, 24)


def test_the_step_cost_counts_the_whole_step(periodic):
    """The drafter's step cost is the whole step on the engine thread, host work included:
    a verification whose bookkeeping takes 0.5 s (on the scheduler's clock) records at least
    that; a step that verified nothing records only its own time."""
    now = [0.0]
    s = make(True)
    s.clock = lambda: now[0]
    recorded: list[tuple[int, float]] = []

    class Recording(StepCost):
        def record(self, rows: int, seconds: float) -> None:
            recorded.append((rows, seconds))

    s.drafter.cost = Recording()  # nothing measured: every proposal is verified whole
    record = s.drafter.record

    def slow_record(req, drafted, accepted):
        now[0] += 0.5
        record(req, drafted, accepted)

    s.drafter.record = slow_record
    reqs = requests(1, n=1)
    run(s, reqs)
    assert s.num_draft_tokens > 0
    slow = [sec for _, sec in recorded if sec >= 0.5]
    assert len(slow) == s.num_drafts and all(sec < 1.0 for sec in slow)
    assert len(recorded) > len(slow)  # the prefill and the steps without a draft
    assert reqs[0].output_token_ids == reference_continuation(reqs[0].prompt_token_ids, 24)


def test_an_ngram_that_went_on_differently_is_its_own_source():
    """'k :' went on with 5, then with 6: a match of ':' drafts the latest (6 ...) but as the
    ambiguous 1-gram source, whose acceptance is learned apart from the unambiguous one."""
    d = Drafter(None, 1, 3)
    r = Request("a", [1, 9, 5, 2, 9, 6, 3, 9], SamplingParams())
    assert d.propose(r, 2) == Proposal([6, 3], "ngram1~")
    r2 = Request("b", [1, 9, 5, 2, 7, 9], SamplingParams())
    assert d.propose(r2, 2) == Proposal([5, 2], "ngram1")


def test_num_draft_tokens_defaults_by_algorithm():
    """Unset, the draft length is the algorithm's default (ngram 8: a lookup costs nothing per
    token; draft 4: each token is a draft-model forward); given, it stands; below 1 refused."""
    assert SchedulerConfig(speculative_algorithm="ngram").speculative_num_draft_tokens == 8
    assert SchedulerConfig(speculative_algorithm="NGRAM").speculative_num_draft_tokens == 8
    assert SchedulerConfig(speculative_algorithm="draft").speculative_num_draft_tokens == 4
    assert SchedulerConfig().speculative_num_draft_tokens == 4
    given = SchedulerConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    assert given.speculative_num_draft_tokens == 3
    with pytest.raises(ConfigError, match="speculative_num_draft_tokens"):
        SchedulerConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=0)
