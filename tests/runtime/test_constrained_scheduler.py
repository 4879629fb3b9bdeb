"""Constrained decoding in the scheduler, with the fake runner and a real xgrammar backend over a
fake one-character-per-token vocabulary: admission waits for compiles without blocking others,
compile failures fail one request, masks, jump-forward extends, n > 1, retraction, limits."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from fake_runner import EOS, VOCAB, FakeRunner, attach_core

from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.constrained import GrammarStep
from radixlm.runtime.grammar.base import CompiledGrammar, GrammarBackend, get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduler, TokenAppender

FIRST = 3  # ids 0..2 are special (EOS = 2); id t >= 3 spells chr(0x30 + t - 3): "0".."l"


def spell(ids: list[int]) -> str:
    return "".join(chr(0x30 + t - FIRST) for t in ids if t >= FIRST)


def encode(text: str) -> list[int]:
    return [ord(c) - 0x30 + FIRST for c in text]


VOCAB_BYTES = tuple(None if t < FIRST else bytes([0x30 + t - FIRST]) for t in range(VOCAB))
FAKE_VOCAB = TokenVocab(VOCAB_BYTES, (EOS,), encode=encode)


class GatedBackend(GrammarBackend):
    """xgrammar, but each compile waits for ``gate`` first."""

    name = "gated"

    def __init__(self, inner: GrammarBackend) -> None:
        super().__init__(inner.vocab)
        self.inner = inner
        self.kinds = inner.kinds  # type: ignore[misc]
        self.schema_support = inner.schema_support  # type: ignore[misc]
        self.gate = threading.Event()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        self.gate.wait(timeout=10)
        return self.inner.compile(constraint)


def manager(jump_forward: bool = True, gated: bool = False, **kw) -> GrammarManager:
    backend = get_backend("xgrammar")(FAKE_VOCAB)
    if gated:
        backend = GatedBackend(backend)
    return GrammarManager(None, VOCAB, [EOS], backend, jump_forward_enabled=jump_forward, **kw)


def make(mgr: GrammarManager, num_pages: int = 64, page_size: int = 4, **cfg) -> Scheduler:
    runner = FakeRunner(num_pages, page_size)
    pool = BlockPool(num_pages, page_size)
    cache = RadixCache(pool)
    appender = TokenAppender(None, [EOS], 4096)
    step = GrammarStep(mgr, runner.device)
    appender.set_grammar(step)
    s = Scheduler(pool, cache, SchedulerConfig(**cfg), appender, 4096, debug_integrity=True)
    return attach_core(s, runner, grammar=step)


def req(
    mgr: GrammarManager | None, rid: str, prompt: list[int], regex: str | None, **params
) -> Request:
    c = Constraint.from_params(regex=regex) if regex is not None else None
    p = SamplingParams(**{"max_new_tokens": 32, "temperature": 0, "constraint": c, **params})
    r = Request(rid, prompt, p)
    if c is not None:
        assert mgr is not None
        mgr.validate(c)
        r.grammar_future = mgr.submit(c)
    return r


def run(s: Scheduler, max_steps: int = 2000) -> None:
    """Step until done, waiting for compiles like the engine loop does (not spinning)."""
    for _ in range(max_steps):
        if not s.has_work():
            return
        for r in s.waiting:
            if r.grammar_pending:
                try:
                    r.grammar_future.result(timeout=10)
                except Exception:  # noqa: BLE001 - the step reports it
                    pass
        s.step()
    raise AssertionError("scheduler did not finish")


def assert_released(s: Scheduler) -> None:
    s.check_integrity()
    assert s.pool.num_held == 0


FORCED = "abc[0-3]defgh[4-6]"  # 3 sampled characters, 8 forced ones


@pytest.mark.parametrize("jump_forward", [True, False])
def test_output_matches_and_jump_forward_extends(jump_forward):
    mgr = manager(jump_forward)
    s = make(mgr)
    r = req(mgr, "a", [5, 6, 7, 8, 9], FORCED)
    s.add_request(r)
    run(s)
    assert re.fullmatch(FORCED, spell(r.output_token_ids))
    assert r.finish_reason == "stop" and r.error is None
    # Finished by the grammar (only EOS could follow): no EOS sampled, no extra forward.
    assert EOS not in r.output_token_ids
    sizes = [b.num_tokens for b in s.runner.batches]
    if jump_forward:
        # prefill; extend "bc" + the sampled "a"; extend the digit + "defgh"
        assert sizes == [5, 3, 6]
        assert s.appender.grammar.num_jump_forward_tokens == 7
    else:
        assert sizes == [5] + [1] * 9
    assert s.num_forwards == len(sizes)
    assert_released(s)


def test_jump_forward_gives_the_same_text_when_tokenization_is_unique():
    texts = []
    for jf in (True, False):
        mgr = manager(jf)
        s = make(mgr, max_batched_tokens=7)  # budget splits the forced extends too
        reqs = [
            req(mgr, str(i), [3 + i, 9, 10 + i], r"[a-f]{2}X?YZ[0-9]{3}(Q|RS)T") for i in range(4)
        ]
        for r in reqs:
            s.add_request(r)
        run(s)
        texts.append([spell(r.output_token_ids) for r in reqs])
        assert_released(s)
    assert texts[0] == texts[1]
    assert all(re.fullmatch(r"[a-f]{2}X?YZ[0-9]{3}(Q|RS)T", t) for t in texts[0])


def test_pending_compile_does_not_block_the_queue():
    mgr = manager(gated=True)
    s = make(mgr)
    a = req(mgr, "a", [5, 6, 7], FORCED)
    b = req(None, "b", [8, 9, 10], None, max_new_tokens=4)
    s.add_request(a)
    s.add_request(b)
    for _ in range(10):
        s.step()
    assert b.is_finished and b.finish_reason == "length"
    assert a.status is RequestStatus.WAITING and a.grammar is None and not a.pages
    assert not s.has_ready_work() and s.has_work()
    mgr.backend.gate.set()  # type: ignore[attr-defined]
    a.grammar_future.result(timeout=10)
    assert s.has_ready_work()
    run(s)
    assert re.fullmatch(FORCED, spell(a.output_token_ids)) and a.finish_reason == "stop"
    assert_released(s)


def test_compile_timeout_fails_only_that_request():
    mgr = manager(gated=True, timeout_s=0.05)
    s = make(mgr)
    a = req(mgr, "a", [5, 6, 7], FORCED)
    b = req(None, "b", [8, 9, 10], None, max_new_tokens=3)
    s.add_request(a)
    s.add_request(b)
    with pytest.raises(Exception, match="longer than"):
        a.grammar_future.result(timeout=10)
    run(s)
    mgr.backend.gate.set()  # type: ignore[attr-defined]
    assert a.finish_reason == "error" and "longer than" in (a.error or "")
    assert not a.output_token_ids
    assert b.finish_reason == "length" and len(b.output_token_ids) == 3
    assert_released(s)


def test_branch_outputs_match_the_grammar():
    mgr = manager()
    s = make(mgr)
    pattern = r"[0-9a-f]{3}=(YES|NO)"
    seen: dict[int, list[int]] = {}
    r = req(mgr, "a", [5, 6, 7, 8, 9, 10], pattern, n=3, temperature=1.0, seed=7)
    r.sink = lambda o: seen.setdefault(o.index, []).extend(o.token_ids)
    s.add_request(r)
    run(s)
    assert sorted(seen) == [0, 1, 2]
    for ids in seen.values():
        assert re.fullmatch(pattern, spell(ids)), spell(ids)
    assert_released(s)


def test_retraction_keeps_the_grammar_in_sync():
    pattern = r"[0-9a-f]{4}(=[a-f]{2}){3}"
    outs = []
    for num_pages in (64, 9):
        mgr = manager()
        s = make(mgr, num_pages=num_pages)
        reqs = [req(mgr, str(i), [3 + i, 5, 7, 9, 11, 13], pattern) for i in range(4)]
        for r in reqs:
            s.add_request(r)
        run(s)
        assert_released(s)
        outs.append([spell(r.output_token_ids) for r in reqs])
        if num_pages == 9:
            assert s.num_retractions > 0
    assert outs[0] == outs[1]
    assert all(re.fullmatch(pattern, t) for t in outs[0])


def test_max_new_tokens_cuts_the_output_with_length():
    mgr = manager()
    s = make(mgr)
    r = req(mgr, "a", [5, 6, 7], FORCED, max_new_tokens=5)
    s.add_request(r)
    run(s)
    text = spell(r.output_token_ids)
    assert len(text) == 5 and "abc0defgh4".startswith(text[:3])  # a prefix of a valid output
    assert r.finish_reason == "length"
    assert_released(s)


def test_min_new_tokens_holds_eos_back_but_never_empties_a_row():
    # The fake model's favourite token is rarely a digit, so the mask decides: EOS (id 2) is
    # the lowest allowed id once one digit exists, and argmax picks it unless suppressed.
    mgr = manager()
    s = make(mgr)
    short = req(mgr, "a", [5, 6, 7], r"[0-9]{1,6}")
    held = req(mgr, "b", [5, 6, 7], r"[0-9]{1,6}", min_new_tokens=4)
    exact = req(mgr, "c", [5, 6, 7], r"[0-9]{2}", min_new_tokens=5)
    for r in (short, held, exact):
        s.add_request(r)
    run(s)
    assert short.output_token_ids[-1] == EOS and len(short.output_token_ids) == 2
    assert len(held.output_token_ids) >= 4
    assert re.fullmatch(r"[0-9]{4,6}", spell(held.output_token_ids))
    # Two digits and the grammar is complete with only EOS left: it stops early ("stop").
    assert re.fullmatch(r"[0-9]{2}", spell(exact.output_token_ids))
    assert exact.finish_reason == "stop"
    assert_released(s)


def test_logprobs_of_forced_tokens_are_zero():
    mgr = manager()
    s = make(mgr)
    r = req(mgr, "a", [5, 6, 7], FORCED, logprobs=True)
    s.add_request(r)
    run(s)
    lps = r.output_logprobs
    assert [lp.token_id for lp in lps] == r.output_token_ids
    forced = [lp.logprob for lp, ch in zip(lps, spell(r.output_token_ids)) if ch in "bcdefgh"]
    assert forced == [0.0] * 7
    sampled = [lp.logprob for lp, ch in zip(lps, spell(r.output_token_ids)) if ch not in "bcdefgh"]
    assert all(v < 0 for v in sampled)  # raw model logprobs (10 vs 0 logits: not 0.0)


def test_abort_while_compiling_cancels_and_releases():
    mgr = manager(gated=True)
    s = make(mgr)
    a = req(mgr, "a", [5, 6, 7], FORCED)
    s.add_request(a)
    s.step()
    assert s.abort("a") and a.finish_reason == "abort"
    assert a.grammar_future.cancelled()
    mgr.backend.gate.set()  # type: ignore[attr-defined]
    assert not s.has_work()
    assert_released(s)


@pytest.mark.parametrize("jump_forward", [True, False])
def test_speculative_drafts_are_walked_through_the_grammar_and_change_nothing(jump_forward):
    """A regex whose output repeats spans of the prompt: drafts (prompt lookup) are walked
    through the grammar, verified under per-row masks (a fork of the matcher advanced through
    the draft's prefix), and the outputs equal plain decoding's."""
    pattern = r"(ab1|cd2|ef3){6}"
    prompt = encode("ab1cd2ef3ab1cd2")
    outs = []
    for spec in (False, True):
        mgr = manager(jump_forward)
        extra = {"speculative_algorithm": "ngram", "speculative_ngram_min": 1} if spec else {}
        s = make(mgr, **extra)
        reqs = [req(mgr, str(i), prompt, pattern) for i in range(3)]
        for r in reqs:
            s.add_request(r)
        run(s)
        for r in reqs:
            assert re.fullmatch(pattern, spell(r.output_token_ids)), spell(r.output_token_ids)
            assert r.finish_reason == "stop" and r.error is None
        outs.append([r.output_token_ids for r in reqs])
        if spec and not jump_forward:
            assert s.num_accepted_draft_tokens > 0
        assert_released(s)
    assert outs[0] == outs[1]


def _walked(pattern: str) -> tuple[GrammarManager, object]:
    from radixlm.runtime.scheduler.admission import take_compiled_grammar

    mgr = manager()
    r = req(mgr, "f", [5], pattern)
    r.grammar_future.result(timeout=30)
    assert take_compiled_grammar(r) is None
    return mgr, r.grammar


def test_a_draft_carries_the_text_the_grammar_forces_after_a_token():
    """After "c" the grammar forces "d2": plain decoding appends it by jump-forward, so a draft
    holds "c" with jump-forward's tokens after it, marked forced, and goes on while the source
    spells them; without jump-forward the draft is the plain walk; a refused token ends it."""
    from radixlm.runtime.scheduler.drafter import draft_token_ok, grammar_draft

    mgr, m = _walked(r"(ab1|cd2)+")
    jf, vocab = mgr.jump_forward, mgr.vocab
    d = grammar_draft(m, encode("cd2ab1"), 8, 8, jf, vocab)
    assert (d.tokens, d.forced, d.num_decided) == (encode("cd2ab1"), {1, 2, 4, 5}, 2)
    d2 = grammar_draft(m, encode("cd2ac"), 8, 8, jf, vocab)  # the source leaves the text
    assert (d2.tokens, d2.forced) == (encode("cd2ab1"), {1, 2, 4, 5})
    assert grammar_draft(m, encode("cdxab1"), 8, 8, jf, vocab).tokens == encode("cd2")
    assert grammar_draft(m, encode("cd2ab1"), 1, 8, jf, vocab).tokens == encode("cd2")  # most
    assert grammar_draft(m, encode("cd2ab1"), 8, 3, jf, vocab).tokens == encode("cd2")  # room
    assert grammar_draft(m, encode("cd2ab1"), 8, 2, jf, vocab).tokens == []  # no room: "c" cut
    assert grammar_draft(m, encode("cd2ab1"), 8, 8).tokens == encode("cd2ab1")  # no jump
    assert grammar_draft(m, encode("cx"), 8, 8).tokens == encode("c")
    # A cut never separates a forced run from the token before it.
    assert d.cut(2).tokens == [] and d.cut(4).tokens == encode("cd2")
    assert d.cut(4).forced == {1, 2} and d.decided(1) == d.cut(3) and d.cut(9) is d
    assert not draft_token_ok(m.fork(), encode("x")[0], jump_forward=False)
    assert m.num_accepted == 0  # walked on forks


def test_a_draft_closes_the_value_its_source_leaves():
    """Where the source's next token is refused (a number followed by a letter) or ends a
    phrase (";" before a special token), the draft closes the value: the closer and the text
    forced after it; nothing is closed where no closer forces text."""
    from radixlm.runtime.scheduler.drafter import grammar_draft

    mgr, m = _walked(r"\[[0-9;]{1,3}\]AB")
    jf, vocab = mgr.jump_forward, mgr.vocab
    m.accept_token(encode("[")[0])
    d = grammar_draft(m, encode("12a"), 8, 8, jf, vocab)  # "a" is refused after "12"
    assert (d.tokens, d.forced) == (encode("12]AB"), {3, 4})
    d = grammar_draft(m, [*encode("1;"), EOS], 8, 8, jf, vocab)  # ";" ends the phrase
    assert (d.tokens, d.forced) == (encode("1]AB"), {2, 3})
    d = grammar_draft(m, encode("1;2"), 8, 8, jf, vocab)  # not a phrase end; "]AB" forced
    assert (d.tokens, d.forced) == (encode("1;2]AB"), {3, 4, 5})
    assert grammar_draft(m, encode("12a"), 2, 8, jf, vocab).tokens == encode("12")  # most
    assert grammar_draft(m, encode("12a"), 8, 4, jf, vocab).tokens == encode("12")  # room
    assert grammar_draft(m, encode("12a"), 8, 8).tokens == encode("12")  # no jump-forward
    mgr2, m2 = _walked(r"[0-9]+[a-c]+")  # no closer: nothing to close with
    assert grammar_draft(m2, encode("12d"), 8, 8, mgr2.jump_forward, mgr2.vocab).tokens == (
        encode("12")
    )


def test_drafts_with_forced_runs_and_closings_change_nothing():
    """Drafts that carry forced text and close values (right or wrong guesses) verify to the
    same outputs as plain decoding, and some of them stand."""
    pattern = r"(\[[0-9]{1,2}\]AB){5}"
    prompts = [encode(p) for p in ("[12]AB[3]AB[45]AB[6", "[7]AB[8a", "[91]AB[91]AB[9")]
    outs, logprobs, seen = [], [], []
    for spec in (False, True):
        mgr = manager()
        extra = {"speculative_algorithm": "ngram", "speculative_ngram_min": 1} if spec else {}
        s = make(mgr, **extra)
        plan = s._plan_drafts

        def spy(cap, plan=plan):
            drafts = plan(cap)
            seen.extend(d for d in drafts.values() if d.forced)
            return drafts

        s._plan_drafts = spy
        reqs = [req(mgr, str(i), p, pattern, logprobs=True) for i, p in enumerate(prompts * 2)]
        for r in reqs:
            s.add_request(r)
        lps: dict[str, list] = {r.request_id: [] for r in reqs}
        for _ in range(2000):
            if not s.has_work():
                break
            for r in s.waiting:
                if r.grammar_pending:
                    r.grammar_future.result(timeout=10)
            for upd in s.step():
                lps[upd.request_id] += [(t.token_id, round(t.logprob, 5)) for t in upd.logprobs]
        for r in reqs:
            assert re.fullmatch(pattern, spell(r.output_token_ids)), spell(r.output_token_ids)
            assert [t for t, _ in lps[r.request_id]] == r.output_token_ids
        outs.append([r.output_token_ids for r in reqs])
        logprobs.append(lps)
        if spec:
            assert seen and s.num_accepted_draft_tokens > 0
        assert_released(s)
    assert outs[0] == outs[1]
    assert logprobs[0] == logprobs[1]  # forced tokens 0.0, as jump-forward's


# Needs the verifier (``not``) and admits no value: every two-digit number the grammar allows
# is refused, so the row runs out of tokens after the first digit (a dead end).
DEAD_END_SCHEMA = {"type": "integer", "minimum": 10, "maximum": 19, "not": {"minimum": 10}}
# Needs the verifier too, and admits 12..19: the look-ahead refuses "1" + a forced end at 10, 11.
NOT_SCHEMA = {"type": "integer", "minimum": 10, "maximum": 19, "not": {"enum": [10, 11]}}


def _schema_req(mgr: GrammarManager, rid: str, schema: dict, **params) -> Request:
    c = Constraint.from_params(json_schema=schema)
    p = SamplingParams(**{"max_new_tokens": 8, "temperature": 0, "constraint": c, **params})
    r = Request(rid, [5, 6, 7, 8], p)
    mgr.validate(c)
    r.grammar_future = mgr.submit(c)
    return r


def test_a_dead_end_fails_only_that_request_and_releases_its_pages():
    """The verifier refuses every continuation: that request ends with ``grammar_dead_end``
    (never an invalid output), its pages are released, the others in the batch finish, and
    the scheduler keeps serving afterwards."""
    mgr = manager()
    s = make(mgr)
    dead = _schema_req(mgr, "dead", DEAD_END_SCHEMA)
    ok = req(mgr, "ok", [9, 10, 11], FORCED)
    verified = [_schema_req(mgr, f"v{i}", NOT_SCHEMA, temperature=1.0, seed=i) for i in range(6)]
    for r in (dead, ok, *verified):
        s.add_request(r)
    run(s)
    assert dead.finish_reason == "error" and dead.error_code == "grammar_dead_end"
    assert re.fullmatch(FORCED, spell(ok.output_token_ids)) and ok.finish_reason == "stop"
    for r in verified:  # the look-ahead kept these clear of dead ends
        assert r.finish_reason == "stop", (r.finish_reason, r.error)
        jsonschema.validate(json.loads(spell(r.output_token_ids)), NOT_SCHEMA)
    # After "1" every continuation is refused: "1" is rolled back and banned, and then nothing
    # is left at the first position either (a second dead end, which fails the request).
    stats = s.appender.grammar.verifier_stats["not"]
    assert (stats.dead_ends, stats.rollbacks) == (2, 1)
    assert_released(s)
    again = req(mgr, "again", [9, 10, 12], FORCED)  # still serving
    s.add_request(again)
    run(s)
    assert re.fullmatch(FORCED, spell(again.output_token_ids))
    assert_released(s)


def test_a_draft_that_fails_to_build_leaves_its_request_decoding_plainly(monkeypatch):
    """An exception while walking one request's draft through its grammar costs that request
    its draft only: it decodes as without drafting, the others still draft, outputs equal."""
    import radixlm.runtime.scheduler.core as core

    pattern = r"(ab1|cd2|ef3){6}"
    prompt = encode("ab1cd2ef3ab1cd2")
    outs, raised = [], []
    for spec in (False, True):
        mgr = manager(jump_forward=False)
        extra = {"speculative_algorithm": "ngram", "speculative_ngram_min": 1} if spec else {}
        s = make(mgr, **extra)
        reqs = [req(mgr, str(i), prompt, pattern) for i in range(3)]
        walk = core.grammar_draft

        def failing(matcher, *a, walk=walk, broken=reqs[0]):
            if matcher is broken.grammar:
                raised.append(broken.request_id)
                raise RuntimeError("backend failure while drafting")
            return walk(matcher, *a)

        monkeypatch.setattr(core, "grammar_draft", failing)
        for r in reqs:
            s.add_request(r)
        run(s)
        for r in reqs:
            assert r.finish_reason == "stop" and r.error is None
            assert re.fullmatch(pattern, spell(r.output_token_ids))
        outs.append([r.output_token_ids for r in reqs])
        if spec:
            assert raised and s.num_accepted_draft_tokens > 0  # the other requests still draft
        assert_released(s)
    assert outs[0] == outs[1]
