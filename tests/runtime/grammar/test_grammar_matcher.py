"""Backend-level matcher behaviour on the real tokenizer, for both backends (no model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from grammar_helpers import BACKENDS, EOS, VOCAB_SIZE, walk

from radixlm.runtime.grammar.base import GrammarBackend, get_backend
from radixlm.runtime.grammar.bitmask import allocate_bitmask, bitmask_to_bool, is_token_allowed
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.vocab import TokenVocab

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b c"]}, "maxItems": 3},
        "score": {"type": "number"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
PERSON_TEXT = '{"name":"Ada Lovelace, née Byron","age":36,"tags":["b c","a"],"score":-1.5e+3}'

Compile = Callable[[str, Constraint], Any]


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _allowed(matcher: Any, token: int) -> bool:
    mask = allocate_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(mask, 0)
    return is_token_allowed(mask, 0, token)


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_tokens_allowed_and_eos_only_at_end(
    backend: str, tokenizer: Any, compile_for: Compile
) -> None:
    ids = _tokens(tokenizer, PERSON_TEXT)
    assert json.loads(PERSON_TEXT)["name"].endswith("Byron")
    matcher = compile_for(backend, Constraint.from_params(json_schema=PERSON)).new_matcher()
    walk(matcher, ids)
    assert matcher.num_accepted == len(ids) + 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("prefix", "bad"),
    [
        ('{"name":', "1"),  # a string is required
        ('{"name":"x","', "score"),  # age is required before score
        ('{"name":"x","age":', '"'),  # an integer, not a string
        ('{"name":"x","age":3', "."),  # integer: no fraction
        ('{"name":"x","age":3', " "),  # compact: no whitespace
        ('{"name":"x","age":3,"tags":["', "c"),  # enum
        ('{"name":"x","age":3,"tags":["a","a","a"', ","),  # maxItems 3
        ('{"name":"x","age":3}', "}"),  # nothing after the object
    ],
)
def test_json_schema_masks_invalid_continuations(
    backend: str, prefix: str, bad: str, tokenizer: Any, compile_for: Compile
) -> None:
    matcher = compile_for(backend, Constraint.from_params(json_schema=PERSON)).new_matcher()
    assert matcher.accept_tokens(_tokens(tokenizer, prefix))
    (bad_id,) = _tokens(tokenizer, bad)
    assert not _allowed(matcher, bad_id)
    before = matcher.num_accepted
    assert not matcher.accept_token(bad_id)
    assert matcher.num_accepted == before  # a rejection changes nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_full_match_and_optional_tail(
    backend: str, tokenizer: Any, compile_for: Compile
) -> None:
    # "1" is a full match that may continue with ".5": outlines-core needs the anchoring.
    c = Constraint.from_params(regex=r"[0-9]+(\.[0-9]+)?")
    walk(compile_for(backend, c).new_matcher(), _tokens(tokenizer, "12.5"), eos_only_at_end=False)
    m = compile_for(backend, c).new_matcher()
    assert m.accept_token(tokenizer.convert_tokens_to_ids("1"))
    assert m.is_completed() and _allowed(m, EOS)
    assert _allowed(m, tokenizer.convert_tokens_to_ids("."))
    assert not _allowed(m, tokenizer.convert_tokens_to_ids("a"))
    phone = Constraint.from_params(regex=r"\(\d{3}\) \d{3}-\d{4}")
    walk(compile_for(backend, phone).new_matcher(), _tokens(tokenizer, "(555) 123-4567"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_choices(backend: str, tokenizer: Any, compile_for: Compile) -> None:
    options = ["a", "ab", "x|y (z)", "new\nline", "中文", 'quo"te']
    c = Constraint.from_params(choices=options)
    for text in options:
        walk(compile_for(backend, c).new_matcher(), _tokens(tokenizer, text), eos_only_at_end=False)
    m = compile_for(backend, c).new_matcher()
    assert m.accept_tokens(_tokens(tokenizer, "a"))
    assert _allowed(m, EOS) and _allowed(m, tokenizer.convert_tokens_to_ids("b"))
    assert not _allowed(m, tokenizer.convert_tokens_to_ids("c"))
    m = compile_for(backend, c).new_matcher()
    assert not m.accept_tokens(_tokens(tokenizer, "x|y z"))
    # all or none: the refused run left nothing accepted (one call for a run in llguidance)
    assert m.num_accepted == 0 and m.accept_tokens(_tokens(tokenizer, "x|y (z)"))
    assert m.is_completed()


def test_ebnf_xgrammar(tokenizer: Any, compile_for: Compile) -> None:
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    c = Constraint.from_params(ebnf=grammar)
    walk(compile_for("xgrammar", c).new_matcher(), _tokens(tokenizer, "The answer is no."))
    m = compile_for("xgrammar", c).new_matcher()
    assert m.accept_tokens(_tokens(tokenizer, "The answer is"))
    assert not _allowed(m, tokenizer.convert_tokens_to_ids("Ġmaybe"))


def test_ebnf_unsupported_by_outlines(backends: dict[str, GrammarBackend]) -> None:
    with pytest.raises(GrammarError, match="ebnf constraints are not supported by the outlines"):
        backends["outlines"].compile(Constraint.from_params(ebnf='root ::= "a"'))


def test_json_object_is_any_compact_object(tokenizer: Any, compile_for: Compile) -> None:
    # outlines compiles arbitrary JSON into a DFA in seconds: xgrammar only here.
    c = Constraint.from_params(json_object=True)
    text = '{"a":[1,{"b":null}],"c":"x","d":{"e":true,"f":[]}}'
    walk(compile_for("xgrammar", c).new_matcher(), _tokens(tokenizer, text))
    for bad in ('{"a":[1, 2]}', '{"a":1, "b":2}', "[1]"):
        m = compile_for("xgrammar", c).new_matcher()
        assert not m.accept_tokens(_tokens(tokenizer, bad)), bad


def test_free_form_values_inside_a_schema_are_compact(tokenizer: Any, compile_for: Compile) -> None:
    schema = {"type": "object", "properties": {"meta": {}}, "required": ["meta"]}
    c = Constraint.from_params(json_schema=schema)
    walk(compile_for("xgrammar", c).new_matcher(), _tokens(tokenizer, '{"meta":{"a":1,"b":[1,2]}}'))
    m = compile_for("xgrammar", c).new_matcher()
    assert not m.accept_tokens(_tokens(tokenizer, '{"meta":{"a":1, "b":2}}'))


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_whitespace_mode(backend: str, tokenizer: Any, compile_for: Compile) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    c = Constraint.from_params(json_schema=schema, whitespace="any")
    walk(compile_for(backend, c).new_matcher(), _tokens(tokenizer, '{\n  "n": 1\n}'))
    m = compile_for(backend, c).new_matcher()
    assert not m.accept_tokens(_tokens(tokenizer, "{" + " " * 17))  # bounded runs


@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_is_independent(backend: str, tokenizer: Any, compile_for: Compile) -> None:
    c = Constraint.from_params(json_schema=PERSON)
    parent = compile_for(backend, c).new_matcher()
    assert parent.accept_tokens(_tokens(tokenizer, '{"name":"A'))
    child = parent.fork()
    a_ids = _tokens(tokenizer, 'da","age":1}')
    b_ids = _tokens(tokenizer, 'l","age":22,"ok":false}')
    walk(child, b_ids)
    assert not parent.is_completed()
    walk(parent, a_ids)
    assert child.num_accepted == parent.num_accepted - len(a_ids) + len(b_ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_and_rebuild(backend: str, tokenizer: Any, compile_for: Compile) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    compiled = compile_for(backend, Constraint.from_params(json_schema=schema))
    ids = _tokens(tokenizer, '{"s":"' + "1234567890" * 8 + '"}')
    assert len(ids) > 70  # longer than outlines' Guide history: rollback replays
    m = compiled.new_matcher(ids)
    assert m.accept_token(EOS) and m.is_terminated()
    m.rollback(1)  # the EOS
    assert not m.is_terminated() and m.is_completed()
    m.rollback(len(ids) - 3)
    assert m.num_accepted == 3 and not m.is_completed()
    walk(m, ids[3:])
    with pytest.raises(ValueError):
        m.rollback(m.num_accepted + 1)
    # Retraction: a fresh matcher rebuilt from the tokens is in the same state.
    rebuilt = compiled.new_matcher(ids[:10])
    fresh = compiled.new_matcher()
    assert fresh.accept_tokens(ids[:10])
    masks = allocate_bitmask(2, VOCAB_SIZE)
    rebuilt.fill_bitmask(masks, 0)
    fresh.fill_bitmask(masks, 1)
    assert bool((masks[0] == masks[1]).all())
    with pytest.raises(GrammarError, match="violates the grammar"):
        compiled.new_matcher([*ids[:2], *_tokens(tokenizer, "}")])


@pytest.mark.parametrize("backend", BACKENDS)
def test_terminated_row_allows_only_eos(backend: str, tokenizer: Any, compile_for: Compile) -> None:
    m = compile_for(backend, Constraint.from_params(choices=["yes", "no"])).new_matcher()
    walk(m, _tokens(tokenizer, "yes"), eos_only_at_end=False)
    mask = allocate_bitmask(1, VOCAB_SIZE)
    m.fill_bitmask(mask, 0)
    assert bitmask_to_bool(mask, VOCAB_SIZE)[0].nonzero().flatten().tolist() == [EOS]
    assert not m.accept_token(EOS) and m.only_eos_allowed()


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_vocab_and_several_eos_ids(backend: str, tokenizer: Any) -> None:
    """A model with more embedding rows than tokens (padding never allowed) and two EOS ids."""
    padded = VOCAB_SIZE + 40
    vocab = TokenVocab.from_tokenizer(tokenizer, padded, [EOS, 0])
    compiled = get_backend(backend)(vocab).compile(Constraint.from_params(regex="[a-z]+"))
    m = compiled.new_matcher()
    mask = allocate_bitmask(1, padded)
    m.fill_bitmask(mask, 0)
    allowed = bitmask_to_bool(mask, padded)[0]
    assert not allowed[VOCAB_SIZE:].any() and not allowed[EOS] and not allowed[0]
    assert allowed[tokenizer.convert_tokens_to_ids("abc")]
    assert m.accept_tokens(_tokens(tokenizer, "abc"))
    m.fill_bitmask(mask, 0)
    allowed = bitmask_to_bool(mask, padded)[0]
    assert allowed[EOS] and allowed[0] and not allowed[VOCAB_SIZE:].any()
    assert m.accept_token(0) and m.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_patterns_that_match_the_empty_string(
    backend: str, tokenizer: Any, compile_for: Compile
) -> None:
    for c in (Constraint("regex", "(ab)*"), Constraint.from_params(choices=["", "ab"])):
        m = compile_for(backend, c).new_matcher()
        assert m.is_completed() and _allowed(m, EOS)  # EOS right away is fine
        walk(m, _tokens(tokenizer, "ab"), eos_only_at_end=False)
    m = compile_for(backend, Constraint("regex", "(ab)*")).new_matcher()
    assert m.accept_tokens(_tokens(tokenizer, "a")) and not _allowed(m, EOS)
