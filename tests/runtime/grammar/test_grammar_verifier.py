"""The verifier beside the grammar (relax + json_track + verifier + verified): unit checks per
keyword, the official suite's files for those keywords, and a walk that decides like decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from grammar_helpers import BACKENDS, BYTE_VOCAB, grammar_accepts

from radixlm.runtime.grammar.base import GrammarMatcher, get_backend
from radixlm.runtime.grammar.bitmask import allocate_bitmask
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.json_track import ScanState, advance, finish
from radixlm.runtime.grammar.relax import VERIFY_KEY, relax_schema
from radixlm.runtime.grammar.strict import verifier_schema_text
from radixlm.runtime.grammar.trackers import JsonTracker, ToolCallsTracker
from radixlm.runtime.grammar.verified import _LAZY, VerifiedGrammar
from radixlm.runtime.grammar.verifier import SchemaVerifier
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.tool_calls import call_begin

SUITE = Path(__file__).parents[2] / "data" / "json_schema_test_suite" / "draft2020-12"
KEYWORD_FILES = ("uniqueItems", "not", "propertyNames", "if-then-else", "oneOf",
                 "unevaluatedProperties", "contains")  # fmt: skip

# (schema, [(instance text, valid?)]): each refusal names the keyword that refuses it.
CASES: list[tuple[dict[str, Any], list[tuple[str, str | None]]]] = [
    (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        [("[1,2,3]", None), ("[1,2,1]", "uniqueItems"), ("[1,1.0]", "uniqueItems"), ("[]", None)],
    ),
    (
        {"type": "array", "items": {"enum": ["a", "b", "c", "d", "e"]}, "uniqueItems": True},
        [('["a","b","c","d","e"]', None), ('["a","b","c","d","e",', "uniqueItems")],
    ),
    (
        {"type": "integer", "not": {"enum": [0, 1, 2, 3, 4]}},
        [("5", None), ("3", "not"), ("30", None)],
    ),
    (
        {
            "type": "object",
            "propertyNames": {"pattern": "^(?!x)[a-z]+$"},
            "additionalProperties": {},
        },
        [
            ('{"ab":1}', None),
            ('{"aB":1}', "propertyNames"),
            ('{"a_', "propertyNames"),
            ('{"xa', "propertyNames"),
        ],
    ),
    (
        {"type": "string", "pattern": "^(?!foo)[a-z]+$"},
        # ending inside an escape: checked up to it (the quote before it is refused)
        [
            ('"bar"', None),
            ('"foo"', "pattern"),
            ('"fo"', None),
            ('"ab\\"\\', "pattern"),
            ('"ab\\u00', None),
            ('"ab\\u0022', "pattern"),
        ],
    ),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"properties": {"a": {"minimum": 10}}},
            "then": {"required": ["b"]},
            "else": {"properties": {"b": {"maximum": 0}}},
        },
        [('{"a":10,"b":1}', None), ('{"a":10}', "if"), ('{"a":1,"b":1}', "if")],
    ),
    (
        {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        [("-5", None), ("20", None), ("5", "oneOf")],
    ),
    (  # overlapping patternProperties: the grammar gets one pattern, the anyOf of the schemas
        {
            "type": "object",
            "patternProperties": {"a": {"type": "integer"}, "b": {"minimum": 3}},
            "additionalProperties": False,
        },
        [('{"ab":4}', None), ('{"b":"x"}', None), ('{"ab":1}', "minimum"), ('{"a":1}', None)],
    ),
    (  # allOf members with overlapping patterns: the members lose them (and additional*)
        {
            "type": "object",
            "allOf": [
                {"patternProperties": {"a": {"type": "number", "minimum": 10}}},
                {"patternProperties": {"b": {"minimum": 3}}, "additionalProperties": False},
            ],
        },
        [
            ('{"ab":10}', None),
            ('{"b":4}', None),
            ('{"ab":5}', "minimum"),
            ('{"c":4}', "additionalProperties"),
        ],
    ),
    (  # anyOf branches whose patterns overlap the object's own: the branches lose them
        {
            "type": "object",
            "patternProperties": {"a": {"type": "integer"}},
            "anyOf": [
                {"patternProperties": {"^.{1,2}$": True}, "additionalProperties": False},
                {"patternProperties": {"^b": {"maximum": 3}}, "additionalProperties": False},
            ],
        },
        [('{"ab":1}', None), ('{"bcd":2}', None), ('{"bcd":4}', "maximum"), ('{"abc":1}', "anyOf")],
    ),
    (  # a $ref target kept under an unknown key is relaxed too
        {
            "type": "object",
            "allOf": [{"$ref": "#/ddd/npn"}, {"$ref": "#/ddd/pp"}],
            "ddd": {
                "npn": {"not": {"propertyNames": {"not": {"const": "a4d"}}}},
                "pp": {"patternProperties": {"^[0-9]+$": {"type": "boolean"}}},
            },
        },
        [('{"a4d":1}', None), ('{"12":true,"a4d":2}', None), ('{"x":1}', "not"), ("{}", "not")],
    ),
    (  # several patterns on one string: the grammar keeps one, the verifier checks the rest
        {"type": "string", "pattern": "^[a-z]+$", "allOf": [{"pattern": "b"}, {"pattern": "c$"}]},
        [('"abc"', None), ('"bc"', None), ('"ab"', "pattern"), ('"cb"', "pattern")],
    ),
    (  # a long minLength beside a pattern
        {"type": "string", "pattern": "^([a-z][0-9])+$", "minLength": 100},
        [('"' + "a1" * 50 + '"', None), ('"a1"', "minLength")],
    ),
    (  # draft 7 `dependencies`, too many triggers to split into cases: 2020-12 keywords
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "dependencies": {"a": ["b"], "b": ["c"], "c": ["d"], "d": {"required": ["e"]}},
        },
        [
            ('{"a":1,"b":1,"c":1,"d":1,"e":1}', None),
            ('{"x":1}', None),
            ('{"a":1}', "dependentRequired"),
            ('{"d":1,"c":1}', "required"),
            ('{"d":1}', "required"),
        ],
    ),
]


def _scan(verifier: SchemaVerifier, text: str) -> str | None:
    """The keyword refusing ``text`` (fed one character at a time, then the end), or None."""
    state = ScanState()
    for ch in text:
        result = advance(state, ch, verifier, verifier.root)
        if isinstance(result, str):
            return result
        state = result
    result = finish(state, verifier, verifier.root)
    return result if isinstance(result, str) else None


@pytest.mark.parametrize("schema,cases", CASES)
def test_verifier_refuses_exactly_the_invalid_completions(
    schema: dict[str, Any], cases: list[tuple[str, str | None]]
) -> None:
    text = verifier_schema_text(json.dumps(schema))
    assert text is not None, "these keywords need the verifier"
    verifier = SchemaVerifier.from_text(text)
    for instance, keyword in cases:
        assert _scan(verifier, instance) == keyword, instance


def test_relaxation_marks_and_removes_the_keywords() -> None:
    schema = {"type": "array", "items": {"type": "string", "not": {"const": "x"}},
              "uniqueItems": True}  # fmt: skip
    relaxed = relax_schema(schema)
    assert "uniqueItems" not in json.dumps(relaxed.grammar)
    assert '"not"' not in json.dumps(relaxed.grammar)
    assert relaxed.verify[VERIFY_KEY] == ["uniqueItems"]
    assert relaxed.verify["items"][VERIFY_KEY] == ["not"]
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert relax_schema(plain).verify is None and relax_schema(plain).grammar is plain


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_a_maps_name_pattern_is_the_grammars(backend: str) -> None:
    """A map's ``propertyNames: {pattern: ^...$}`` becomes its ``patternProperties`` (with
    ``additionalProperties: false``): the grammar alone is exact, no verifier; the grammar
    accepts what ``jsonschema`` finds valid. Beside ``properties``, with an unanchored pattern
    or other name keywords it stays the verifier's; a lookaround leaves the grammar the plain
    part and the verifier the rest."""
    schema = {"type": "object", "propertyNames": {"pattern": "^[a-z]{2,3}$"},
              "additionalProperties": {"type": "integer"}, "maxProperties": 3}  # fmt: skip
    relaxed = relax_schema(schema)
    assert relaxed.verify is None or "propertyNames" not in json.dumps(relaxed.verify)
    assert verifier_schema_text(json.dumps(schema)) is None
    compiled = get_backend(backend)(BYTE_VOCAB).compile(Constraint.from_params(json_schema=schema))
    texts = ['{"ab":1}', '{"abc":1,"xy":2}', '{"a":1}', '{"abcd":1}', '{"aB":1}', '{"ab":"x"}',
             '{"ab":1,"cd":2,"ef":3,"gh":4}', "{}", '{"12":1}']  # fmt: skip
    for text in texts:
        valid = jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert grammar_accepts(compiled.new_matcher(), text) == valid, text
    for other in (
        {**schema, "properties": {"id": {"type": "integer"}}},
        {**schema, "propertyNames": {"pattern": "[a-z]"}},
        {**schema, "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3}},
    ):
        assert "propertyNames" in relax_schema(other).verify[VERIFY_KEY], other
    looked = relax_schema({**schema, "propertyNames": {"pattern": "^(?!ab)[a-z]{2,3}$"}})
    assert looked.verify[VERIFY_KEY] == ["propertyNames"]
    assert "^[a-z]{2,3}$" in json.dumps(looked.grammar)
    # outlines has no patternProperties: there the verifier checks the names
    assert relax_schema(schema, names_as_patterns=False).verify[VERIFY_KEY] == ["propertyNames"]
    outlines = get_backend("outlines")(BYTE_VOCAB)
    compiled = outlines.compile(Constraint.from_params(json_schema={
        k: v for k, v in schema.items() if k != "maxProperties"}))  # fmt: skip
    assert isinstance(compiled, VerifiedGrammar)
    assert grammar_accepts(compiled.new_matcher(), '{"ab":1}')
    assert not grammar_accepts(compiled.new_matcher(), '{"aB":1}')


def test_required_names_left_undeclared_are_declared_for_the_grammar() -> None:
    """Names normalization did not declare (here: beside a ``$ref``) get ``{}``; weaker than
    ``additionalProperties``' schema, so the verifier checks that object."""
    schema = {"type": "object", "$ref": "#/$defs/d", "required": ["a"],
              "additionalProperties": {"type": "integer"},
              "$defs": {"d": {"uniqueItems": True}}}  # fmt: skip
    relaxed = relax_schema(schema)
    assert relaxed.grammar["properties"] == {"a": {}}
    assert "required" in relaxed.verify[VERIFY_KEY]
    verifier = SchemaVerifier(relaxed.verify)
    assert _scan(verifier, '{"a":1}') is None
    assert _scan(verifier, '{"a":"x"}') is not None


def test_a_finished_document_is_checked_at_the_root() -> None:
    """Below ``anyOf`` no position is known: the root's check still refuses the document."""
    schema = {"anyOf": [{"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                        {"type": "string"}]}  # fmt: skip
    verifier = SchemaVerifier.from_text(verifier_schema_text(json.dumps(schema)) or "")
    assert _scan(verifier, "[1,2]") is None
    assert _scan(verifier, "[1,1]") == "uniqueItems"  # named from the error's schema path


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", KEYWORD_FILES)
def test_suite_files_of_the_verified_keywords(backend: str, name: str) -> None:
    """The official suite's files for these keywords: every invalid instance of an accepted
    schema is refused by grammar + verifier; valid ones are counted (most accepted)."""
    grammar_backend = get_backend(backend)(BYTE_VOCAB)
    groups = json.loads((SUITE / f"{name}.json").read_text())
    valid = valid_accepted = verified = 0
    for group in groups:
        schema = group["schema"]
        try:
            c = Constraint.from_params(json_schema=schema)
            assert c is not None
            grammar_backend.validate(c)
            compiled = grammar_backend.compile(c)
        except GrammarError:
            continue
        verified += isinstance(compiled, VerifiedGrammar)
        cls = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
        for case in group["tests"]:
            text = json.dumps(case["data"], separators=(",", ":"), ensure_ascii=False)
            accepted = grammar_accepts(compiled.new_matcher(), text)
            assert cls(schema).is_valid(case["data"]) == case["valid"]
            if not case["valid"]:
                assert not accepted, f"{name}: {group['description']}: {case['description']}"
            else:
                valid += 1
                valid_accepted += accepted
    if backend != "outlines":  # outlines refuses these files' schemas for other reasons
        assert verified > 0, f"no schema of {name}.json needed the verifier"
    assert valid_accepted >= valid // 2, (valid_accepted, valid)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_check_token_refuses_a_token_whose_forced_continuation_is_refused(backend: str) -> None:
    """One step ahead: ``0`` where the grammar then forces ``}`` (or allows only EOS) and the
    schema refuses 0 is refused at ``0``, not left a dead end at the next step."""
    grammar_backend = get_backend(backend)(BYTE_VOCAB)
    obj = {"type": "object", "additionalProperties": False, "required": ["n"],
           "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9,
                                "not": {"enum": [0, 1]}}}}  # fmt: skip
    for schema, prefix in ((obj, b'{"n":'), (obj["properties"]["n"], b"")):
        m = grammar_backend.compile(Constraint.from_params(json_schema=schema)).new_matcher()
        assert m.accept_tokens(list(prefix))
        refused = {chr(t) for t in b"0123456789" if m.check_token(t) is not None}
        assert refused == {"0", "1"}, (schema, refused)
        assert m.num_accepted == len(prefix)  # checking changed nothing
        assert m.accept_token(ord("0"))  # its own bytes complete nothing: accepted
    # inside a string: after "x the grammar forces a" and the quote completes a refused value
    text = {"type": "string", "pattern": "^(xa|yb)$", "not": {"pattern": "^x"}}
    m = grammar_backend.compile(Constraint.from_params(json_schema=text)).new_matcher()
    assert m.accept_token(ord('"'))
    assert m.check_token(ord("x")) == "not" and m.check_token(ord("y")) is None


def _chain(depth: int) -> Any:
    """``{"a": {"a": ... {}}}`` with the empty object ``depth`` levels down."""
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


# Depth counters intersected: a chain of "a" whose empty object lies at a depth d with
# d % 2 == 1 and d % 3 == 2 (d = 5, 11, 17, ...), d = 5 excluded by ``not``. The backends cannot
# intersect recursive references; normalization unrolls them to a depth, then the verifier.
MOD6 = {
    "allOf": [{"$ref": "#/$defs/word"}, {"$ref": "#/$defs/x0"}, {"$ref": "#/$defs/y0"},
              {"not": {"const": _chain(5)}}],
    "$defs": {
        "word": {"type": "object", "properties": {"a": {"$ref": "#/$defs/word"}},
                 "additionalProperties": False},
        "x0": {"additionalProperties": {"$ref": "#/$defs/x1"}, "minProperties": 1},
        "x1": {"additionalProperties": {"$ref": "#/$defs/x0"}},
        "y0": {"additionalProperties": {"$ref": "#/$defs/y1"}, "minProperties": 1},
        "y1": {"additionalProperties": {"$ref": "#/$defs/y2"}, "minProperties": 1},
        "y2": {"additionalProperties": {"$ref": "#/$defs/y0"}},
    },
}  # fmt: skip
# Several patterns on one string through $ref, and a long minLength beside them.
REF_PATTERNS = {
    "allOf": [{"$ref": "#/$defs/p0"}, {"$ref": "#/$defs/p1"}],
    "minLength": 70,
    "$defs": {"p0": {"pattern": "^([a-z][0-9])+$"}, "p1": {"pattern": "(t8){3}$"}},
}


def test_conjunctions_the_backends_cannot_intersect_go_to_the_verifier() -> None:
    """Depth-unrolled recursive ``allOf`` and patterns behind ``$ref``: llguidance compiles the
    relaxation; grammar + verifier accept exactly what ``jsonschema`` validates."""
    grammar_backend = get_backend("llguidance")(BYTE_VOCAB)
    strings = ["a1" * 32 + "t8t8t8", "a1" * 36, "a1" * 10 + "t8t8t8", "b2" * 40 + "t8" * 3]
    groups = [(MOD6, [_chain(d) for d in range(0, 48)]), (REF_PATTERNS, strings)]
    for schema, instances in groups:
        c = Constraint.from_params(json_schema=schema)
        assert c is not None
        grammar_backend.validate(c)
        compiled = grammar_backend.compile(c)
        assert isinstance(compiled, VerifiedGrammar)
        validator = jsonschema.Draft202012Validator(schema)
        accepted = 0
        for value in instances:
            text = json.dumps(value, separators=(",", ":"))
            ok = grammar_accepts(compiled.new_matcher(), text)
            assert ok == validator.is_valid(value), text[:80]
            accepted += ok
        assert accepted >= 2  # chains of depth 11, 17, ...; two of the strings


TAGS = {"type": "object", "properties": {
    "n": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}  # fmt: skip


def _walked(schema: Any, text: str, kind: str = "json_schema") -> Any:
    backend = get_backend("xgrammar")(BYTE_VOCAB)
    m = backend.compile(Constraint.from_params(**{kind: schema})).new_matcher()
    assert m.accept_tokens(list(text.encode())), text
    return m


# The root refuses on its own (``not`` of a property's value): a dead end at its end may need
# any of its tokens back, the key before an inner checked value included.
ROOT_NOT = {**TAGS, "additionalProperties": False,
            "not": {"properties": {"n": {"const": 1}}, "required": ["n"]}}  # fmt: skip


def test_settled_tokens_end_at_the_outermost_open_value_the_verifier_may_refuse() -> None:
    """What a dead end may take back (and the scheduler holds back from the client): from the
    start of the outermost open value that may be refused by its own keywords. In ``TAGS``
    that is the ``uniqueItems`` array (the root's subtree holds the keyword, but only at a
    position the verifier names, checked when the array ends): held from ``[``, its items
    included, until it closes."""
    text = '{"n":1,"tags":["a","b'
    m = _walked(TAGS, text)
    assert m.num_settled() == text.index("[")
    assert m.accept_token(ord('"'))
    assert m.num_settled() == text.index("[")
    assert m.accept_tokens(list(b"]}"))
    assert m.num_settled() == m.num_accepted  # the document is complete
    # Tool calls: the same, at the arguments' offset in the whole output.
    spec = {"mode": "required", "parallel": False,
            "tools": [{"name": "f", "parameters": TAGS}]}  # fmt: skip
    call = call_begin("f") + text
    m = _walked(json.dumps(spec), call, kind="tool_calls")
    assert m.num_settled() == call.index("[")


def test_settled_tokens_never_decrease_and_hold_a_root_that_refuses_on_its_own() -> None:
    """``ROOT_NOT``: the root itself may be refused at its end, so nothing is settled before
    it ends (the innermost rule released ``{"n":2,"tags":`` inside the array, and a dead end
    at ``}`` that needs another key could not be left). Monotone along every prefix."""
    for schema, text in [(ROOT_NOT, '{"n":2,"tags":["a","b"]}'),
                         (TAGS, '{"n":1,"tags":["a","b"]}')]:  # fmt: skip
        m = _walked(schema, "")
        settled = []
        for byte in text.encode():
            assert m.accept_token(byte), chr(byte)
            settled.append(m.num_settled())
        assert settled == sorted(settled)
        if schema is ROOT_NOT:
            assert settled[:-1] == [0] * (len(text) - 1)
        assert settled[-1] == len(text)


def test_backtrack_rolls_back_and_bans_the_token_at_its_position() -> None:
    m = _walked(TAGS, '{"tags":["a","a')
    n = m.num_accepted
    assert m.backtrack(n, "uniqueItems", budget=4) == 0  # released: cannot be taken back
    assert m.backtrack(n - 1, "uniqueItems", budget=4) == 1
    assert m.num_accepted == n - 1 and m.num_rollbacks == 1
    assert m.check_token(ord("a")) == "uniqueItems" and not m.accept_token(ord("a"))
    assert m.fork().check_token(ord("a")) == "uniqueItems"  # a fork keeps the bans
    assert m.accept_token(ord("b"))
    assert m.check_token(ord('"')) is None
    m.rollback(2)  # back before the ban's position: the ban is forgotten
    assert m.accept_tokens(list(b'"a'))
    assert m.backtrack(0, "uniqueItems", budget=1) == 0  # the budget is spent


def test_an_incomplete_character_is_refused_when_no_completion_can_continue_the_pattern() -> None:
    """A token ending inside a UTF-8 character, in a string with a prefix check: refused when
    none of the characters it can complete to continues the text (every continuation would be
    a dead end), kept when one can (``é`` = C3 A9 under ``[a-zé]``)."""
    ascii_only = {"type": "string", "pattern": "^(?!x)[a-z]{1,3}$"}
    m = _walked(ascii_only, '"ab')
    assert m.check_token(0xC3) == "pattern"
    assert m.check_token(ord("c")) is None
    accented = {"type": "string", "pattern": "^(?!x)[a-zé]{1,3}$"}
    m = _walked(accented, '"ab')
    assert m.check_token(0xC3) is None
    assert m.accept_token(0xC3) and m.check_token(0xA9) is None
    assert m.check_token(0xA8) == "pattern"  # è: not in the class


class _Counting:
    """``inner`` with the last argument of each call of its method ``name`` recorded in
    ``calls``: the verifier's modules may be compiled (``native``), whose methods and instances
    cannot be patched."""

    def __init__(self, inner: Any, name: str, calls: list[Any]) -> None:
        self._inner, self._name, self._calls = inner, name, calls

    def __getattr__(self, attr: str) -> Any:
        method = getattr(self._inner, attr)
        if attr != self._name:
            return method

        def counted(*args: Any) -> Any:
            self._calls.append(args[-1])
            return method(*args)

        return counted


def _count_validations(v: SchemaVerifier, nodes: Any, calls: list[Any]) -> None:
    """Record in ``calls`` each instance validated against ``nodes`` (the module may be
    compiled: no method patching, so the validators are wrapped)."""
    for n in nodes:
        fast = v._fast_validator(n)
        if fast is not None:
            v._fast[id(n)] = _Counting(fast, "is_valid", calls)
        else:
            v._validators[id(n)] = _Counting(v._validator_for(n), "iter_errors", calls)


def test_a_completed_value_is_validated_once_per_schema_position() -> None:
    """The verdict on a value text at a position is cached: the same answers, one
    ``jsonschema`` validation for each distinct (position, text)."""
    v = SchemaVerifier.from_text(verifier_schema_text(json.dumps(ROOT_NOT)))
    calls: list[Any] = []
    _count_validations(v, v.root, calls)
    answers = [v.value(v.root, text) for text in ('{"n":1}', '{"n":2}', '{"n":1}')]
    assert answers == ["not", None, "not"]
    assert calls == [{"n": 1}, {"n": 2}]


def test_values_checked_as_they_are_generated_are_not_validated_again() -> None:
    """``uniqueItems`` (item by item) and ``propertyNames`` (key by key) are checked in full as
    the value is generated, and a position whose relaxed keywords all sit at known positions
    below it (``TAGS``' root) had them checked there: walking a document validates nothing
    at those positions, and a repeated item is still refused, at the item."""
    schema = {**TAGS, "propertyNames": {"pattern": "^(?!x)"}}
    v = SchemaVerifier.from_text(verifier_schema_text(json.dumps(schema)))
    calls: list[Any] = []
    tags = v.child(v.root, "tags")
    _count_validations(v, (*v.root, *tags), calls)
    tracker = JsonTracker(v)
    state = tracker.feed(tracker.start(), b'{"n":1,"tags":["a","b"]}')
    assert not isinstance(state, str) and calls == []
    assert tracker.feed(tracker.start(), b'{"n":1,"tags":["a","a"') == "uniqueItems"
    assert tracker.feed(tracker.start(), b'{"n":1,"xy":') == "propertyNames"
    assert calls == []
    # ``not`` on the root is its own: validated where the root completes.
    v = SchemaVerifier.from_text(verifier_schema_text(json.dumps(ROOT_NOT)))
    _count_validations(v, v.root, calls)
    assert JsonTracker(v).feed(ScanState(), b'{"n":1}') == "not" and calls == [{"n": 1}]


def test_a_run_accepted_at_once_has_the_states_of_one_token_at_a_time() -> None:
    """``accept_tokens`` feeds a run to the tracker at once; the states inside it, read later
    (``num_settled``, a rollback into the run), are those of accepting token by token; a run
    with a refused value is refused whole and changes nothing."""
    text = '{"n":1,"tags":["a","b"]}'
    at_once = _walked(TAGS, text)  # one run
    one_by_one = _walked(TAGS, "")
    for byte in text.encode():
        assert one_by_one.accept_token(byte)
    assert at_once._states[1:-1].count(_LAZY) == len(text) - 1  # nothing read them yet
    for k in range(len(text) + 1):
        assert at_once._state(k) == one_by_one._states[k]
    at_once = _walked(TAGS, text)
    at_once.rollback(5)  # into the run: the new last state is computed
    assert at_once._states[-1] == one_by_one._states[len(text) - 5]
    assert at_once.accept_tokens(list(text[-5:].encode())) and at_once.is_completed()
    m = _walked(TAGS, '{"tags":["a"')
    before = list(m._states)
    assert not m.accept_tokens(list(b',"a"'))  # a repeated item
    assert m._states == before and m.num_accepted == len('{"tags":["a"')


def test_accepting_the_forced_text_after_a_checked_token_reuses_its_state(monkeypatch) -> None:
    """``check_token(t)`` fed the forced text after ``t``; accepting ``t`` and then that text
    (jump-forward) feeds the tracker no more."""
    m = _walked(TAGS, '{"tags":["a","b"')
    assert m.check_token(ord("]")) is None  # '}' is forced after it, and fed here
    fed: list[bytes] = []
    monkeypatch.setattr(m, "tracker", _Counting(m.tracker, "feed", fed))
    assert m.accept_token(ord("]")) and m.inner.forced_bytes() == b"}"
    m.rollback(1)  # jump-forward re-spells the sampled token with the forced text
    assert m.accept_tokens(list(b"]}")) and m.is_completed()
    assert fed == []
    m.rollback(2)  # or keeps it and appends the forced text as one token of its own
    assert m.check_token(ord("]")) is None and m.accept_token(ord("]"))
    assert fed == [b"]", b"}"]  # checked afresh after the rollback
    fed.clear()
    assert m.accept_tokens([ord("}")]) and m.is_completed()
    assert fed == []
    m.rollback(1)
    assert m.accept_token(ord("}")) and fed == []  # one token: the same reuse


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_checked_token_is_accepted_by_the_backend_once(backend: str, monkeypatch) -> None:
    """``check_token(t)`` leaves ``t`` accepted by the backend's matcher; ``accept_token(t)``
    then adopts it (one backend acceptance, forced bytes known), while anything else (another
    token, a mask, a rollback, a fork) first takes it back: every answer is the one of a
    matcher that never checked."""
    grammar = get_backend(backend)(BYTE_VOCAB).compile(Constraint.from_params(json_schema=TAGS))
    text = '{"n":1,"tags":["a","b"'
    m, fresh = grammar.new_matcher(), grammar.new_matcher()
    assert m.accept_tokens(list(text.encode())) and fresh.accept_tokens(list(text.encode()))
    masks = allocate_bitmask(2, BYTE_VOCAB.vocab_size)
    fresh.fill_bitmask(masks, 0)
    for t in b"],x":
        m.check_token(t)
        assert m.num_accepted == len(text)
        m.fill_bitmask(masks, 1)
        assert torch.equal(masks[0], masks[1])
    accepted: list[int] = []
    inner_accept = m.inner.accept_token
    monkeypatch.setattr(m.inner, "accept_token", lambda t: accepted.append(t) or inner_accept(t))
    assert m.check_token(ord("]")) is None and m.check_token(ord(",")) is None
    assert m.accept_token(ord(",")) and accepted == [ord("]"), ord(",")]  # "]" taken back
    assert m.forced_bytes() == b'"' and m.num_accepted == len(text) + 1
    m.rollback(1)
    assert m.check_token(ord("]")) is None and m.accept_token(ord("]"))
    assert accepted[-1:] == [ord("]")] and len(accepted) == 3  # adopted: no second acceptance
    assert m.forced_bytes() == b"}" and fresh.accept_token(ord("]"))
    assert fresh.forced_bytes() == b"}"
    assert m.check_token(ord("}")) is None
    fork = m.fork()
    assert fork.num_accepted == m.num_accepted == len(text) + 1
    assert fork.accept_token(ord("}")) and fork.only_eos_allowed()
    m.rollback(1)
    assert m.num_accepted == len(text) and m.accept_tokens(list(b"]}")) and m.only_eos_allowed()


def test_llguidance_only_eos_allowed_agrees_with_the_mask() -> None:
    """llguidance answers ``only_eos_allowed`` from its own state; along every prefix of
    documents that end in a number (the grammar complete yet open) and in a bracket, the
    answer is the mask's (``GrammarMatcher.only_eos_allowed``)."""
    backend = get_backend("llguidance")(BYTE_VOCAB)
    for schema, text in [({"type": "integer"}, "120"), (TAGS, '{"n":12,"tags":["a"]}'),
                         ({"type": "array", "items": {"type": "integer"}}, "[1,22]")]:  # fmt: skip
        m = backend.compile(Constraint.from_params(json_schema=schema)).new_matcher()
        inner = m.inner if hasattr(m, "inner") else m
        for byte in text.encode():
            assert m.accept_token(byte)
            assert inner.only_eos_allowed() == GrammarMatcher.only_eos_allowed(inner), text
        assert inner.only_eos_allowed() == (text[-1] in "]}")


DRAFT_URIS = {"draft2020-12": "https://json-schema.org/draft/2020-12/schema",
              "draft7": "http://json-schema.org/draft-07/schema#"}  # fmt: skip


@pytest.mark.parametrize("draft", list(DRAFT_URIS))
def test_rs_and_jsonschema_agree_on_the_suite(draft: str) -> None:
    """Where the verifier validates with ``jsonschema_rs`` (``SchemaVerifier._fast_validator``),
    its verdict on every instance of the official suite is ``jsonschema``'s (the reference) and
    the suite's own; the schemas it leaves to ``jsonschema`` (regex, format, ...) are many."""
    checked = left = 0
    uri = DRAFT_URIS[draft]
    for path in sorted((SUITE.parent / draft).glob("*.json")):
        for group in json.loads(path.read_text()):
            schema = group["schema"]
            if not isinstance(schema, dict) or schema.get("$schema", uri) != uri:
                continue  # a custom metaschema (the vocabulary tests)
            if "http" in json.dumps({k: x for k, x in schema.items() if k != "$schema"}):
                continue  # remote references: neither validator fetches them
            schema = {"$schema": uri, **schema}
            v = SchemaVerifier(schema)
            if v._fast_validator(schema) is None:
                left += 1
                continue
            reference = jsonschema.validators.validator_for(schema)(schema)
            for case in group["tests"]:
                checked += 1
                assert reference.is_valid(case["data"]) == case["valid"]
                refusal = v._refusal(schema, case["data"])
                where = (path.name, group["description"], case["description"], refusal)
                assert (refusal is None) == case["valid"], where
    assert checked > 200 and left > 50, (checked, left)


def test_tool_call_heads_are_found_however_the_text_is_split() -> None:
    """``ToolCallsTracker`` finds each call's head (where checked arguments start) in text
    fed in pieces of any size, as fed a character at a time: the same states, the same
    refusal of a repeated item in the second call's arguments."""
    tags = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    tracker = ToolCallsTracker({call_begin(n): SchemaVerifier.from_text(
        verifier_schema_text(json.dumps(tags)) or "") for n in ("f", "ff")})  # fmt: skip
    good = f'x{call_begin("ff")}{{"t":[1,2]}} and {call_begin("f")}{{"t":[3]}}'
    bad = f'{call_begin("f")}{{"t":[]}}{call_begin("ff")}{{"t":[4,4]}}'

    def fed(text: str, sizes: list[int]) -> Any:
        state, data, k = tracker.start(), text.encode(), 0
        for size in sizes * len(data):
            if k >= len(data):
                break
            state = tracker.feed(state, data[k : k + size])
            if isinstance(state, str):
                return state
            k += size
        return state

    for text in (good, bad):
        one_by_one = fed(text, [1])
        for sizes in ([len(text)], [2], [3, 1], [7], [5, 11]):
            assert fed(text, sizes) == one_by_one, (text, sizes)
    assert fed(bad, [1]) == "uniqueItems" and not isinstance(fed(good, [1]), str)
    assert fed(good, [1]).head is None and fed(good[:-2], [1]).head == call_begin("f")


# Single bytes plus tokens of several characters (a quote or a backslash inside or first, a
# two-byte character, one cut inside it), EOS last.
_MULTI = ("ab", "abc", "zz", 'a"', 'z",', '"', '":', " a", "te", "test", "Te", "é", "éa", "\\u",
          "\\n", "xyz", "a1", "09", "a-b")  # fmt: skip
MULTI_VOCAB = TokenVocab(
    tuple(bytes([b]) for b in range(256)) + tuple(t.encode() for t in _MULTI) + (b"\xc3",)
    + (None,), (257 + len(_MULTI),), encode=lambda s: list(s.encode()),
)  # fmt: skip


_TOOL = {"mode": "required", "parallel": False, "tools": [{"name": "f", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "pattern": "^(?!x)[a-z]+$"}},
    "required": ["c"]}}]}  # fmt: skip
_HEAD = call_begin("f")


@pytest.mark.parametrize(
    ("kind", "spec", "texts"),
    [  # (text walked, some token refused by its first character there)
        ("json_schema", {"type": "string", "pattern": "^(?!test)[a-z]{1,4}$"},
         [('"', True), ('"tes', True), ('"abcd', True), ("", False)]),
        ("json_schema", {"type": "string", "pattern": "^(?!test)"},
         [('"tes', True), ('"a\\n', False), ('"\\ttes', False)]),
        # the string's text is not its value after an escape: no test there
        ("json_schema", {"type": "string", "pattern": "^(?!\\\\)"}, [('"\\t', False)]),
        ("json_schema", {"type": "object", "propertyNames": {"pattern": "^(?!zz)[a-z]{2,3}$"},
                         "additionalProperties": {"type": "integer"}},
         [('{"', True), ('{"abc', True), ('{"ab":1,"x', True), ('{"ab":', False)]),
        ("tool_calls", json.dumps(_TOOL),
         [(_HEAD + '{"c":"', True), (_HEAD + '{"c":"ab', True), (_HEAD[:-1], False),
          (_HEAD + "{", False)]),
    ],
)  # fmt: skip
def test_first_character_refusals_are_refusals_of_check_token(kind, spec, texts) -> None:
    """``quick_refusals`` (a scan's shortcut inside a string with a prefix check) refuses only
    tokens that ``check_token`` refuses, with the same keyword; some inside checked strings,
    none outside one (or after an escape), where it has no test."""
    backend = get_backend("llguidance")(MULTI_VOCAB)  # reads patterns as searches
    compiled = backend.compile(Constraint.from_params(**{kind: spec}))
    tokens = list(range(MULTI_VOCAB.vocab_size - 1))  # EOS is never refused by it
    for text, some in texts:
        m = compiled.new_matcher()
        assert m.accept_tokens(list(text.encode())), text
        quick = m.quick_refusals(tokens)
        for t, keyword in quick.items():
            assert m.check_token(t) == keyword, (text, MULTI_VOCAB.token_bytes[t])
        assert bool(quick) == some, text


def test_settled_counts_kept_across_tokens_match_a_fresh_count() -> None:
    """``num_settled`` keeps its answer while the open value's start is the same; along walks
    that take back tokens and spell the text again in other pieces (bytes, or tokens of
    several), each answer is a fresh matcher's."""
    import random

    text = '{"n":1,"tags":["ab","abc",'
    ids = {MULTI_VOCAB.token_bytes[t]: t for t in range(256, 256 + len(_MULTI))}
    backend = get_backend("llguidance")(MULTI_VOCAB)
    compiled = backend.compile(Constraint.from_params(json_schema=TAGS))
    rng = random.Random(0)

    def pieces(data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            multi = [b for b in ids if data.startswith(b, i)] if rng.random() < 0.7 else []
            piece = max(multi, key=len) if multi else data[i : i + 1]
            out.append(ids.get(piece, piece[0]))
            i += len(piece)
        return out

    m = compiled.new_matcher()
    for _ in range(30):
        done = MULTI_VOCAB.join(m._tokens)
        for t in pieces(text.encode()[len(done) :]):
            assert m.accept_token(t)
            fresh = compiled.new_matcher()
            assert fresh.accept_tokens(list(m._tokens))
            assert m.num_settled() == fresh.num_settled()
        m.rollback(rng.randrange(1, m.num_accepted + 1))
