"""Leaving a verifier's dead end by rollback, through the composed scheduler and executor on a
scripted fake model that walks into dead ends: the request rolls back and completes with output
that ``jsonschema`` accepts; rolled-back tokens are never streamed nor cached; pages are
trimmed and released; a spent budget ends the request with ``grammar_dead_end`` while the
engine keeps serving."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from fake_runner import EOS, VOCAB, FakeRunner, attach_core

from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.constrained import GrammarStep
from radixlm.runtime.grammar.base import get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.runtime.request import Request, RequestOutput
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduler, TokenAppender

# One character per token (ids 0..2 are special, EOS = 2): enough for JSON.
ALPHABET = '{}[],:" 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQ'
assert len(ALPHABET) == VOCAB - 3
PROMPT = [40, 41, 42, 43, 44]


def encode(text: str) -> list[int]:
    return [ALPHABET.index(c) + 3 for c in text]


def spell(ids: list[int]) -> str:
    return "".join(ALPHABET[t - 3] for t in ids if t >= 3)


VOCAB_BYTES = (None, None, None, *(c.encode() for c in ALPHABET))
JSON_VOCAB = TokenVocab(VOCAB_BYTES, (EOS,), encode=encode)


class SpellTokenizer:
    """The detokenizer's view of ``ALPHABET``: one character per token."""

    def decode(self, ids: list[int], **_: object) -> str:
        return spell(ids)


class ScriptedRunner(FakeRunner):
    """Prefers the next character of ``script`` while the output (read back from the KV pages)
    spells a prefix of it, else the characters of ``fallback`` in order; EOS comes where the
    grammar allows nothing else. Stale K/V after a rollback would derail the script."""

    def __init__(self, script: str, fallback: str, num_pages: int = 64) -> None:
        super().__init__(num_pages=num_pages, page_size=4)
        self.script = script
        self.fallback = fallback

    def next_logits(self, context: list[int]) -> torch.Tensor:  # [V]
        row = torch.zeros(VOCAB)
        for k, c in enumerate(self.fallback):
            row[ALPHABET.index(c) + 3] = 50.0 - k
        text = spell(context[len(PROMPT) :])
        if len(text) < len(self.script) and self.script.startswith(text):
            row[ALPHABET.index(self.script[len(text)]) + 3] = 100.0
        return row


def make(
    runner: ScriptedRunner, max_rollbacks: int | None = None, backend_name: str = "xgrammar"
) -> Scheduler:
    backend = get_backend(backend_name)(JSON_VOCAB)
    mgr = GrammarManager(None, VOCAB, [EOS], backend)
    pool = BlockPool(runner.num_pages, runner.page_size)
    appender = TokenAppender(SpellTokenizer(), [EOS], 4096)
    step = GrammarStep(mgr, runner.device, *([] if max_rollbacks is None else [max_rollbacks]))
    appender.set_grammar(step)
    s = Scheduler(pool, RadixCache(pool), SchedulerConfig(), appender, 4096, debug_integrity=True)
    s.mgr = mgr
    return attach_core(s, runner, grammar=step)


def submit(
    s: Scheduler, schema: dict, rid: str = "r", prompt: list[int] = PROMPT
) -> tuple[Request, list[RequestOutput]]:
    c = Constraint.from_params(json_schema=schema)
    deltas: list[RequestOutput] = []
    params = SamplingParams(max_new_tokens=48, temperature=0, constraint=c)
    r = Request(rid, list(prompt), params, sink=deltas.append)
    s.mgr.validate(c)
    r.grammar_future = s.mgr.submit(c)
    r.grammar_future.result(timeout=30)
    s.appender.init_request(r)
    s.add_request(r)
    return r, deltas


def run(s: Scheduler, watch: Request | None = None) -> list[int]:
    """Step until done; returns how many tokens ``watch`` held back after each step, checking
    that its pages fit its tokens and that no held token is in the tree."""
    held = []
    for _ in range(500):
        if not s.has_work():
            return held
        s.step()
        if watch is not None and not watch.is_finished:
            held.append(len(watch.held))
            assert len(watch.pages) <= -(-watch.num_tokens // s.page_size)  # none past them
            cached = s.cache.match_prefix(watch.token_ids, watch.namespace).num_tokens
            assert cached <= watch.num_final_tokens - 1
    raise AssertionError("scheduler did not finish")


def streamed(deltas: list[RequestOutput]) -> list[int]:
    """The tokens streamed, checking that the text streamed spells them (the detokenizer,
    replayed after each rollback, agrees with what was released)."""
    tokens = [t for d in deltas for t in d.token_ids]
    assert "".join(d.text for d in deltas) == spell(tokens)
    return tokens


def stats(s: Scheduler, keyword: str) -> tuple[int, int]:
    st = s.appender.grammar.verifier_stats[keyword]
    return st.dead_ends, st.rollbacks


# Needs the verifier (a small enum would compile to a grammar of its permutations).
UNIQUE = {
    "type": "array",
    "items": {"type": "string", "pattern": "^(ab|ac|b)$"},
    "uniqueItems": True,
}
# Only 100..109: after "11" (or "12", ...) every third digit is refused.
HUNDREDS = {"type": "integer", "minimum": 100, "maximum": 199, "not": {"minimum": 110}}


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "outlines"])
def test_a_unique_items_dead_end_rolls_back_and_completes_valid(backend):
    """``["ac","ab","a`` has no valid completion (both "ab" and "ac" are taken): the "a" is
    rolled back (each backend's matcher) and banned, the model's next choice "b" completes a
    valid array. The open item's tokens were held back: the stream never showed the "a"."""
    runner = ScriptedRunner('["ac","ab","a', fallback='"]b,ac')
    s = make(runner, backend_name=backend)
    r, deltas = submit(s, UNIQUE)
    held = run(s, watch=r)
    out = spell(r.output_token_ids)
    assert r.finish_reason == "stop", (r.finish_reason, r.error)
    jsonschema.validate(json.loads(out), UNIQUE)
    assert out == '["ac","ab","b"]'
    assert streamed(deltas) == r.output_token_ids  # nothing streamed was taken back
    assert deltas[-1].finished and max(held) > 0
    assert stats(s, "uniqueItems") == (1, 1)
    assert s.pool.num_held == 0
    s.check_integrity()


def test_repeated_dead_ends_walk_back_through_the_value():
    """Each second digit but "0" leads to a dead end one digit later: nine rollbacks (each
    banning one digit at the second position), then "10x" completes."""
    runner = ScriptedRunner("11", fallback="1234567890")
    s = make(runner)
    r, deltas = submit(s, HUNDREDS)
    run(s, watch=r)
    out = spell(r.output_token_ids)
    assert r.finish_reason == "stop", (r.finish_reason, r.error)
    jsonschema.validate(json.loads(out), HUNDREDS)
    assert out == "101"
    assert stats(s, "not") == (9, 9)
    assert streamed(deltas) == r.output_token_ids
    assert s.pool.num_held == 0
    s.check_integrity()


def test_a_spent_budget_ends_with_grammar_dead_end_and_the_engine_keeps_serving():
    runner = ScriptedRunner("11", fallback="1234567890")
    s = make(runner, max_rollbacks=3)
    r, deltas = submit(s, HUNDREDS)
    run(s)
    assert r.finish_reason == "error" and r.error_code == "grammar_dead_end"
    assert stats(s, "not") == (4, 3)
    assert streamed(deltas) == []  # the number was never settled: nothing was released
    assert s.pool.num_held == 0
    s.check_integrity()
    again, _ = submit(s, UNIQUE, rid="again")  # still serving
    run(s)
    assert again.finish_reason == "stop"
    jsonschema.validate(json.loads(spell(again.output_token_ids)), UNIQUE)
    assert s.pool.num_held == 0


def test_retraction_caches_no_held_token_and_the_rollback_still_completes():
    """A pool too small for both requests: one is retracted (its computed pages cached, then
    matched when it comes back) in the middle of a long item it holds back; the tree never
    holds those tokens (``run`` checks each step) and both complete valid after a rollback."""
    schema = {**UNIQUE, "items": {"type": "string", "pattern": "^(ab|ac|b|abcdefghijkl)$"}}
    runner = ScriptedRunner('["ac","ab","abcdefghijkl","a', fallback='"]b,ac', num_pages=12)
    s = make(runner)
    a, a_deltas = submit(s, schema, "a")
    b, b_deltas = submit(s, schema, "b", prompt=[45, 46, 47, 48, 49])
    run(s, watch=b)
    assert s.num_retractions > 0 and b.num_retractions > 0
    for r, deltas in ((a, a_deltas), (b, b_deltas)):
        assert r.finish_reason == "stop", (r.finish_reason, r.error)
        assert spell(r.output_token_ids) == '["ac","ab","abcdefghijkl","b"]'
        assert streamed(deltas) == r.output_token_ids
    assert stats(s, "uniqueItems") == (4, 4)  # each: "ab" then "ac" turn out used
    assert s.pool.num_held == 0
    s.check_integrity()


# The root refuses any "a" (its own ``not``), found only at its end; "a"'s value is checked
# too (its own ``not``), so the rule "hold the innermost open checked value" released
# ``{"a":`` while that value was open, and the dead end at the root's end could not be left.
ENCLOSING = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 2, "not": {"const": 2}},
                   "c": {"type": "integer", "minimum": 0, "maximum": 9}},
    "additionalProperties": False, "minProperties": 1,
    "not": {"properties": {"a": {"minimum": 0}}, "required": ["a"]},
}  # fmt: skip


def test_a_dead_end_of_an_enclosing_value_rolls_back_into_text_held_from_its_start():
    """The root may be refused by its own keyword, so everything is held from its ``{``: the
    dead ends after ``{"a":1`` walk back through the inner value and the key, ban ``a``, and
    ``{"c":0}`` completes; the stream equals the final text and nothing was released early."""
    runner = ScriptedRunner('{"a":1', fallback='}",:ac0123456789')
    s = make(runner, max_rollbacks=64)
    r, deltas = submit(s, ENCLOSING)
    held = run(s, watch=r)
    out = spell(r.output_token_ids)
    assert r.finish_reason == "stop", (r.finish_reason, r.error)
    jsonschema.validate(json.loads(out), ENCLOSING)
    assert out == '{"c":0}'
    assert streamed(deltas) == r.output_token_ids
    assert all(not d.text for d in deltas[:-1])  # held to the end: the root may refuse
    dead_ends, rollbacks = stats(s, "not")
    assert dead_ends == rollbacks > 0
    assert min(held) > 0
    assert s.pool.num_held == 0
    s.check_integrity()
