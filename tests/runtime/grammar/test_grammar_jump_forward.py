"""Jump-forward: forced text, token boundaries, budget, and the must-stop signal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from grammar_helpers import BACKENDS, EOS, walk

from radixlm.runtime.grammar.base import GrammarBackend
from radixlm.runtime.grammar.bitmask import allocate_bitmask, is_token_allowed
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.jump_forward import jump_forward
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.grammar.vocab import TokenVocab

NAME = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
    "additionalProperties": False,
}
Compile = Callable[[str, Constraint], Any]


def _c(**kwargs: Any) -> Constraint:
    c = Constraint.from_params(**kwargs)
    assert c is not None
    return c


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_state_forces_the_object_head(
    backend: str, tokenizer: Any, vocab: TokenVocab, compile_for: Compile
) -> None:
    m = compile_for(backend, _c(json_schema=NAME)).new_matcher()
    assert m.forced_bytes() == b'{"name":"'
    jf = jump_forward(m, vocab)
    assert jf.num_rollback == 0 and not jf.must_stop
    assert list(jf.token_ids) == tokenizer.encode('{"name":"')
    assert m.num_accepted == len(jf.token_ids) and m.forced_bytes() == b""
    walk(m, tokenizer.encode('Bob"}'))  # the state is right after the jump


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_token_isretokenized_with_the_forced_text(
    backend: str, tokenizer: Any, vocab: TokenVocab, compile_for: Compile
) -> None:
    """The model sampled "{" (allowed), the grammar forces '"name":"': re-tokenizing "{" with it
    replaces "{" by '{"' -- the same tokens tokenizer.encode gives for the whole text."""
    if backend == "llguidance":
        pytest.skip("llguidance allows only the canonical tokens of forced text: never '{' here")
    m = compile_for(backend, _c(json_schema=NAME)).new_matcher()
    (brace,) = tokenizer.encode("{")
    mask = allocate_bitmask(1, vocab.vocab_size)
    m.fill_bitmask(mask, 0)
    assert is_token_allowed(mask, 0, brace) and m.accept_token(brace)
    assert m.forced_bytes() == b'"name":"'
    jf = jump_forward(m, vocab, [brace])
    expected = tokenizer.encode("{" + '"name":"')
    assert expected[0] != brace
    assert jf.num_rollback == 1 and list(jf.token_ids) == expected
    assert vocab.join(jf.token_ids) == b'{"name":"'
    assert m.num_accepted == len(expected)
    # Without a token to roll back, the forced text is tokenized alone.
    m2 = compile_for(backend, _c(json_schema=NAME)).new_matcher([brace])
    jf2 = jump_forward(m2, vocab, [])
    assert jf2.num_rollback == 0 and list(jf2.token_ids) == tokenizer.encode('"name":"')


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_brace_then_must_stop(
    backend: str, tokenizer: Any, vocab: TokenVocab, compile_for: Compile
) -> None:
    m = compile_for(backend, _c(json_schema=NAME)).new_matcher()
    ids = tokenizer.encode('{"name":"Bob"')
    assert m.accept_tokens(ids)
    jf = jump_forward(m, vocab, ids[-1:])
    assert vocab.join(jf.token_ids) == vocab.join(ids[len(ids) - jf.num_rollback :]) + b"}"
    assert jf.must_stop and m.is_completed() and m.only_eos_allowed()
    again = jump_forward(m, vocab, [])
    assert again.is_noop and again.must_stop
    assert m.accept_token(EOS) and jump_forward(m, vocab).must_stop


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_jump_where_there_is_a_choice(
    backend: str, tokenizer: Any, vocab: TokenVocab, compile_for: Compile
) -> None:
    m = compile_for(backend, _c(json_schema=NAME)).new_matcher(tokenizer.encode('{"name":"'))
    jf = jump_forward(m, vocab)
    assert jf.is_noop and not jf.must_stop
    choice = compile_for(backend, _c(choices=["yes", "no"])).new_matcher()
    assert jump_forward(choice, vocab).is_noop
    num = compile_for(backend, _c(regex=r"[0-9]+(\.[0-9]+)?")).new_matcher(tokenizer.encode("1"))
    assert num.forced_bytes() == b"" and jump_forward(num, vocab).is_noop  # EOS or more digits


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_caps_the_jump(
    backend: str, tokenizer: Any, vocab: TokenVocab, compile_for: Compile
) -> None:
    m = compile_for(backend, _c(json_schema=NAME)).new_matcher()
    jf = jump_forward(m, vocab, max_tokens=2)
    assert list(jf.token_ids) == tokenizer.encode('{"name":"')[:2]
    assert m.num_accepted == 2
    assert jump_forward(m, vocab, max_tokens=0).is_noop
    rest = jump_forward(m, vocab)
    assert vocab.join(jf.token_ids + rest.token_ids) == b'{"name":"'


@pytest.mark.parametrize("backend", BACKENDS)
def test_multibyte_forced_text(
    backend: str, tokenizer: Any, vocab: TokenVocab, compile_for: Compile
) -> None:
    c = _c(regex="中文(甲|乙)")
    m = compile_for(backend, c).new_matcher()
    assert m.forced_bytes() == "中文".encode()
    jf = jump_forward(m, vocab)
    assert vocab.join(jf.token_ids) == "中文".encode()
    walk(m, tokenizer.encode("乙"))
    # Mid-character: the first byte of 中 is a token of its own in this vocabulary.
    first = vocab.single_byte_ids["中".encode()[0]]
    assert first is not None
    m2 = compile_for(backend, c).new_matcher([first])
    jf2 = jump_forward(m2, vocab, [first])
    if backend == "xgrammar":
        # xgrammar cannot return a forced string that starts inside a character: no jump.
        assert jf2.is_noop and m2.num_accepted == 1
        return
    assert jf2.num_rollback == 1
    assert vocab.join(jf2.token_ids) == "中文".encode()
    assert list(jf2.token_ids) == tokenizer.encode("中文")


def test_both_backends_force_the_same_text(
    tokenizer: Any, compile_for: Compile, backends: dict[str, GrammarBackend]
) -> None:
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "kind": {"const": "user"},
            "tags": {"enum": ["x"]},
        },
        "required": ["id", "kind", "tags"],
    }
    text = '{"id":12,"kind":"user","tags":"x"}'
    ids = tokenizer.encode(text)
    forced = {}
    for name in BACKENDS:
        m = compile_for(name, _c(json_schema=schema)).new_matcher()
        seen = [m.forced_bytes()]
        for t in ids:
            assert m.accept_token(t)
            seen.append(m.forced_bytes())
        forced[name] = seen
    assert forced["xgrammar"] == forced["outlines"]
    assert forced["xgrammar"][0] == b'{"id":'
    assert b'kind":"user","tags":"x"}' in forced["xgrammar"]  # after the ',"' token


def test_manager_flag_disables_jumping(tokenizer: Any, backends: dict[str, GrammarBackend]) -> None:
    with GrammarManager(None, 0, (), backends["xgrammar"], jump_forward_enabled=False) as mgr:
        m = mgr.new_matcher(mgr.compile_sync(_c(json_schema=NAME)))
        assert mgr.jump_forward(m, []).is_noop and m.num_accepted == 0
        mgr.jump_forward_enabled = True
        assert vocab_bytes(mgr, mgr.jump_forward(m, []).token_ids) == b'{"name":"'


def vocab_bytes(mgr: GrammarManager, ids: tuple[int, ...]) -> bytes | None:
    return mgr.vocab.join(ids)


def test_respelling_is_remembered_per_vocabulary(tokenizer: Any, vocab: TokenVocab) -> None:
    """The re-spelling of (sampled tail, forced bytes) is the tokenizer's the first time and
    the same answer after, without calling it again; one that does not round-trip stays None;
    another vocabulary asks its own tokenizer."""
    from radixlm.runtime.grammar.jump_forward import retokenize

    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return list(tokenizer.encode(text, add_special_tokens=False))

    counted = TokenVocab(vocab.token_bytes, vocab.eos_token_ids, encode)
    (brace,) = tokenizer.encode("{")
    first = retokenize(counted, [brace], b'"name":"')
    assert first is not None and calls == ['{"name":"']
    rollback, ids = first
    assert rollback == 1 and counted.join(ids) == b'{"name":"'
    again = retokenize(counted, [brace], b'"name":"')
    assert again == first and len(calls) == 1
    again[1].append(0)  # the caller's list is its own
    assert retokenize(counted, [brace], b'"name":"') == first
    assert retokenize(counted, [], b"\xff") is None and len(calls) == 1  # no valid text
    other = TokenVocab(vocab.token_bytes, vocab.eos_token_ids, encode)
    assert retokenize(other, [brace], b'"name":"') == first and len(calls) == 2
