"""Constraints: construction, normalization, validation errors and JSON-schema strictness.

The support tables in ``strict.py`` are claims about the backends; the "enforced" test below
checks each claimed keyword against a valid and an invalid instance, so a table that says a
backend enforces something it ignores fails here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from grammar_helpers import BACKENDS, BYTE_VOCAB, grammar_accepts

from radixlm.runtime.grammar.base import GrammarBackend, get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.strict import (
    OUTLINES_SUPPORT,
    XGRAMMAR_SUPPORT,
    find_unsupported,
)
from radixlm.runtime.grammar.verified import VerifiedGrammar

Compile = Callable[[str, Constraint], Any]


# ---- Constraint.from_params ---------------------------------------------------------------------


def test_from_params_none_and_at_most_one() -> None:
    assert Constraint.from_params() is None
    with pytest.raises(ValueError, match="json_schema and regex"):
        Constraint.from_params(json_schema={"type": "string"}, regex="a")
    with pytest.raises(GrammarError, match="choices and json_object"):
        Constraint.from_params(choices=["a"], json_object=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": [1, 2]}, "json_schema"),
        ({"regex": ""}, "regex"),
        ({"ebnf": "  "}, "ebnf"),
        ({"choices": []}, "choices"),
        ({"choices": ["a", 1]}, "choices"),
        ({"regex": "a", "whitespace": "pretty"}, "whitespace"),
    ],
)
def test_from_params_malformed_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GrammarError, match=field):
        Constraint.from_params(**kwargs)


def test_schema_normalization_is_a_stable_cache_key() -> None:
    a = Constraint.from_params(
        json_schema={"type": "object", "properties": {"z": {"type": "string"}, "a": {}}}
    )
    b = Constraint.from_params(
        json_schema='{"properties": {"z": {"type": "string"}, "a": {}}, "type": "object"}'
    )
    assert a == b and hash(a) == hash(b)
    # Property order is the generated key order: it is kept, keywords are sorted.
    assert (
        a is not None and a.spec == '{"properties":{"z":{"type":"string"},"a":{}},"type":"object"}'
    )
    other = Constraint.from_params(json_schema={"properties": {"a": {}, "z": {"type": "string"}}})
    assert other != a
    # Data keeps its order too (a const object is generated as written).
    c = Constraint.from_params(json_schema={"const": {"b": 1, "a": 2}})
    assert c is not None and json.loads(c.spec)["const"] == {"b": 1, "a": 2}
    assert list(json.loads(c.spec)["const"]) == ["b", "a"]
    assert Constraint("choices", '["x", "y"]') == Constraint.from_params(choices=("x", "y", "x"))


# ---- validation errors --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "strnig"}, "invalid JSON schema"),
        ({"type": "string", "minLength": -1}, "invalid JSON schema at #/minLength"),
        ({"properties": 5}, "invalid JSON schema"),
        (False, "matches nothing"),
    ],
)
def test_invalid_schema_is_an_error(
    backend: str, schema: Any, needle: str, backends: dict[str, GrammarBackend]
) -> None:
    c = Constraint.from_params(json_schema=schema)
    assert c is not None
    with pytest.raises(GrammarError, match=needle):
        backends[backend].validate(c)
    with pytest.raises(GrammarError, match=needle):
        backends[backend].compile(c)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("regex", ["a(b", "[z-a]", "a{3,1}", "(?<=a)b"])
def test_invalid_regex_is_an_error(
    backend: str, regex: str, backends: dict[str, GrammarBackend]
) -> None:
    c = Constraint.from_params(regex=regex)
    assert c is not None
    with pytest.raises(GrammarError, match="regex"):
        backends[backend].compile(c)


def test_outlines_anchoring_cannot_change_a_regex(backends: dict[str, GrammarBackend]) -> None:
    # "(?:" + R + ")$" would turn this invalid R into a valid, different pattern.
    c = Constraint.from_params(regex="a)|(?:b")
    assert c is not None
    with pytest.raises(GrammarError, match="invalid regex"):
        backends["outlines"].validate(c)


def test_invalid_ebnf_is_an_error(backends: dict[str, GrammarBackend]) -> None:
    c = Constraint.from_params(ebnf="root ::= undefined_rule")
    assert c is not None
    with pytest.raises(GrammarError, match="undefined_rule"):
        backends["xgrammar"].validate(c)


# ---- strictness ---------------------------------------------------------------------------------

S = dict
# keyword -> schema that uses it; each is valid against the metaschema.
KEYWORD_SCHEMAS: dict[str, dict[str, Any]] = {
    "uniqueItems": S(type="array", items=S(type="integer"), uniqueItems=True),
    "contains": S(type="array", contains=S(const=5)),
    "minContains": S(type="array", contains=S(const=5), minContains=2),
    "not": S(type="integer", **{"not": S(const=3)}),
    "if": S(type="integer", **{"if": S(minimum=5), "then": S(maximum=7)}),
    "dependentRequired": S(type="object", dependentRequired={k: ["b"] for k in "acde"}),
    "dependentSchemas": S(type="object", dependentSchemas={k: S(required=["b"]) for k in "acde"}),
    "multipleOf (on a non-integer schema)": S(type="number", multipleOf=0.5),
    "allOf (with sibling keywords)": S(type="integer", multipleOf=3, allOf=[S(multipleOf=5)]),
    "oneOf (branches not provably disjoint)": S(
        oneOf=[S(type="string"), S(type="string", maxLength=3)]
    ),
    "format: 'regex'": S(type="string", format="regex"),
    'minLength (without "type")': S(minLength=3),
    "required: 'a' (not in properties)": S(
        type="object", required=["a"], additionalProperties=False
    ),
    'format (without "type")': S(format="duration"),
    "$ref: 'https://example.com/s.json' (external reference)": {
        "$ref": "https://example.com/s.json"
    },
}
OUTLINES_ONLY: dict[str, dict[str, Any]] = {
    "minimum": S(type="integer", minimum=5),
    "exclusiveMaximum": S(type="number", exclusiveMaximum=5),
    "multipleOf": S(type="integer", multipleOf=3),
    "maxProperties": S(type="object", maxProperties=1),
    "propertyNames": S(type="object", propertyNames=S(pattern="^a")),
    "patternProperties": S(type="object", patternProperties={"^a": S(type="integer")}),
    "format: 'duration'": S(type="string", format="duration"),
    "minProperties": S(type="object", properties=S(a=S(type="integer")), minProperties=1),
    "minItems (with prefixItems)": S(type="array", prefixItems=[S(type="integer")], minItems=1),
}


# How the error names a keyword when it differs between backends.
NAMED_AS = {("outlines", "multipleOf (on a non-integer schema)"): "multipleOf"}
# Even in best-effort mode these backends cannot build a grammar for these schemas: still an
# error for that request only.
CANNOT_COMPILE = {
    ("xgrammar", "minContains"),
    ("outlines", "allOf (with sibling keywords)"),
    ("outlines", "required: 'a' (not in properties)"),
    ("outlines", "format: 'regex'"),
    ("outlines", "format: 'duration'"),
    ("outlines", "$ref: 'https://example.com/s.json' (external reference)"),
    ("outlines", 'minLength (without "type")'),
    ("outlines", 'format (without "type")'),
    ("llguidance", "$ref: 'https://example.com/s.json' (external reference)"),
    ("llguidance", "required: 'a' (not in properties)"),  # unsatisfiable: llguidance says so
}


# What llguidance enforces where the others do not (checked against instances below).
LLGUIDANCE_ENFORCES = frozenset(
    {
        "multipleOf (on a non-integer schema)",
        "allOf (with sibling keywords)",
        'minLength (without "type")',
        'format (without "type")',
    }
)


# Enforced by the verifier beside the grammar (``relax`` / ``verifier``): accepted in strict mode.
VERIFIED = frozenset(
    {"uniqueItems", "contains", "minContains", "not", "if", "propertyNames",
     "oneOf (branches not provably disjoint)", "dependentRequired", "dependentSchemas"}
)  # fmt: skip


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    out = [
        (b, k, s)
        for b in BACKENDS
        for k, s in KEYWORD_SCHEMAS.items()
        if not (b == "llguidance" and k in LLGUIDANCE_ENFORCES) and k not in VERIFIED
    ]
    return out + [("outlines", k, s) for k, s in OUTLINES_ONLY.items() if k not in VERIFIED]


def _verified_cases() -> list[tuple[str, str, dict[str, Any]]]:
    schemas = {**KEYWORD_SCHEMAS, "propertyNames": OUTLINES_ONLY["propertyNames"]}
    return [(b, k, schemas[k]) for b in ("xgrammar", "llguidance") for k in sorted(VERIFIED)]


@pytest.mark.parametrize(("backend", "keyword", "schema"), _verified_cases())
def test_verified_keyword_is_accepted_in_strict_mode_with_a_verifier(
    backend: str, keyword: str, schema: dict[str, Any], backends: dict[str, GrammarBackend]
) -> None:
    nested = {"type": "object", "properties": {"field": schema}, "required": ["field"]}
    strict = Constraint.from_params(json_schema=nested)
    assert strict is not None
    backends[backend].validate(strict)
    assert isinstance(backends[backend].compile(strict), VerifiedGrammar)


@pytest.mark.parametrize(("backend", "keyword", "schema"), _cases())
def test_unsupported_keyword_is_rejected_by_name_unless_best_effort(
    backend: str,
    keyword: str,
    schema: dict[str, Any],
    backends: dict[str, GrammarBackend],
) -> None:
    nested = {"type": "object", "properties": {"field": schema}, "required": ["field"]}
    strict = Constraint.from_params(json_schema=nested)
    assert strict is not None
    with pytest.raises(GrammarError) as err:
        backends[backend].validate(strict)
    message = str(err.value)
    assert f"{NAMED_AS.get((backend, keyword), keyword)} (at #/properties/field)" in message
    assert backend in message and "best-effort" in message
    lenient = Constraint.from_params(json_schema=nested, best_effort=True)
    assert lenient is not None
    if (backend, keyword) in CANNOT_COMPILE:
        with pytest.raises(GrammarError):
            backends[backend].compile(lenient)
        return
    backends[backend].validate(lenient)
    if backend == "xgrammar":  # outlines' generic-JSON DFAs take seconds: validate only
        backends[backend].compile(lenient)


def test_unsupported_keywords_are_all_listed_and_annotations_pass() -> None:
    schema = {
        "title": "T",
        "description": "annotations constrain nothing",
        "type": "object",
        "properties": {
            "tags": {"type": "array", "uniqueItems": True, "items": {"format": "regex"}},
            "uniqueItems": {
                "type": "string",
                "examples": ["a property may be named like a keyword"],
            },
            "n": {"type": "number", "multipleOf": 2, "default": 4},
        },
        "x-vendor": {"uniqueItems": True},  # unknown keywords are not walked
    }
    found = {(u.keyword, u.path) for u in find_unsupported(schema, XGRAMMAR_SUPPORT)}
    assert found == {
        ("uniqueItems", "#/properties/tags"),
        ("format: 'regex'", "#/properties/tags/items"),
        ('format (without "type")', "#/properties/tags/items"),
        ("multipleOf (on a non-integer schema)", "#/properties/n"),
    }
    # Keys are strings: a pattern under propertyNames needs no "type".
    keys = {"type": "object", "propertyNames": {"pattern": "^a"}, "additionalProperties": True}
    assert find_unsupported(keys, XGRAMMAR_SUPPORT) == []
    assert ("multipleOf", "#/properties/n") in {
        (u.keyword, u.path) for u in find_unsupported(schema, OUTLINES_SUPPORT)
    }
    assert find_unsupported({"type": "array", "uniqueItems": False}, XGRAMMAR_SUPPORT) == []


# keyword -> (schema, valid instance, invalid instance), for keywords a backend claims to enforce.
ENFORCED: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "pattern": (S(type="string", pattern="^a+$"), "aaa", "ab"),
    "format": (S(type="string", format="date"), "2024-01-02", "yesterday"),
    "minLength": (S(type="string", minLength=3), "abc", "ab"),
    "maxLength": (S(type="string", maxLength=3), "abc", "abcd"),
    "minItems": (S(type="array", items=S(type="integer"), minItems=2), [1, 2], [1]),
    "maxItems": (S(type="array", items=S(type="integer"), maxItems=2), [1, 2], [1, 2, 3]),
    "prefixItems": (S(type="array", prefixItems=[S(type="string")], items=False), ["a"], [1]),
    "enum": (S(enum=["a", 1]), "a", "b"),
    "const": (S(const="a"), "a", "b"),
    "anyOf": (S(anyOf=[S(type="string"), S(type="integer")]), 1, [1]),
    "allOf": (S(allOf=[S(type="integer")]), 4, "x"),
    "required": (S(type="object", properties=S(a=S(type="integer")), required=["a"]), {"a": 1}, {}),
    "additionalProperties": (
        S(type="object", additionalProperties=S(type="integer")),
        {"a": 1, "b": 2},
        {"a": 1, "b": "x"},
    ),
    "minProperties": (
        S(type="object", additionalProperties=S(type="integer"), minProperties=1),
        {"a": 1},
        {},
    ),
    "$ref": (
        {
            "$defs": {"x": S(type="integer")},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/x"}},
        },
        {"a": 1},
        {"a": "s"},
    ),
    "minimum": (S(type="integer", minimum=5), 5, 4),
    "exclusiveMaximum": (S(type="number", exclusiveMaximum=2), 1.5, 2),
    "multipleOf": (S(type="integer", multipleOf=3), 6, 7),
    "maxProperties": (
        S(type="object", additionalProperties=S(type="integer"), maxProperties=1),
        {"a": 1},
        {"a": 1, "b": 2},
    ),
    "propertyNames": (
        S(type="object", propertyNames=S(pattern="^a.*$"), additionalProperties=S(type="integer")),
        {"ab": 1},
        {"b": 1},
    ),
    "patternProperties": (
        S(
            type="object",
            patternProperties={"^a.*$": S(type="integer")},
            additionalProperties=False,
        ),
        {"ab": 1},
        {"b": 1},
    ),
}


def _enforced_cases() -> list[tuple[str, str]]:
    support = {b: get_backend(b).schema_support for b in BACKENDS}
    return [(b, k) for b in BACKENDS for k in ENFORCED if k in support[b].keywords]


def _accepts(compiled: Any, tokenizer: Any, instance: Any) -> bool:
    text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    matcher = compiled.new_matcher()
    return matcher.accept_tokens(tokenizer.encode(text)) and matcher.is_completed()


@pytest.mark.parametrize(("backend", "keyword"), _enforced_cases())
def test_claimed_keywords_are_enforced(
    backend: str, keyword: str, tokenizer: Any, compile_for: Compile
) -> None:
    schema, good, bad = ENFORCED[keyword]
    c = Constraint.from_params(json_schema=schema)
    assert c is not None
    compiled = compile_for(backend, c)
    assert _accepts(compiled, tokenizer, good)
    assert not _accepts(compiled, tokenizer, bad)


FORMAT_EXAMPLES = {
    "email": "a@b.co",
    "date": "2024-01-02",
    "time": "10:11:12Z",
    "date-time": "2024-01-02T10:11:12Z",
    "duration": "P1D",
    "uuid": "12345678-1234-1234-1234-123456789abc",
    "uri": "http://a.b/c",
    "uri-reference": "/c",
    "uri-template": "/a/{b}",
    "ipv4": "1.2.3.4",
    "ipv6": "::1",
    "hostname": "a.com",
    "json-pointer": "/a",
    "relative-json-pointer": "0/a",
}


def _format_cases() -> list[tuple[str, str]]:
    support = {b: get_backend(b).schema_support for b in BACKENDS}
    return [(b, f) for b in BACKENDS for f in sorted(support[b].formats)]


@pytest.mark.parametrize(("backend", "fmt"), _format_cases())
def test_claimed_formats_are_enforced(
    backend: str, fmt: str, tokenizer: Any, compile_for: Compile
) -> None:
    schema = S(type="string", format=fmt)
    compiled = compile_for(backend, Constraint("json_schema", json.dumps(schema)))
    assert not _accepts(compiled, tokenizer, "not valid !!{{ ((")
    assert _accepts(compiled, tokenizer, FORMAT_EXAMPLES[fmt])


LLGUIDANCE_INSTANCES: dict[str, tuple[Any, Any]] = {
    "multipleOf (on a non-integer schema)": (1.5, 1.2),
    "allOf (with sibling keywords)": (15, 3),
    'minLength (without "type")': ("abc", "ab"),
    'format (without "type")': ("P1D", "P1"),
}


@pytest.mark.parametrize("keyword", sorted(LLGUIDANCE_INSTANCES))
def test_llguidance_enforces_what_the_others_refuse(
    keyword: str, tokenizer: Any, compile_for: Compile
) -> None:
    good, bad = LLGUIDANCE_INSTANCES[keyword]
    nested = {"type": "object", "properties": {"field": KEYWORD_SCHEMAS[keyword]}}
    nested |= {"required": ["field"], "additionalProperties": False}
    c = Constraint.from_params(json_schema=nested)
    assert c is not None
    compiled = compile_for("llguidance", c)
    assert _accepts(compiled, tokenizer, {"field": good})
    assert not _accepts(compiled, tokenizer, {"field": bad})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", [r"^(?:ab*)?a$", r"^(ab+)?a$", r"^(?:b*@)?a*$", r"^x(y)?$"])
def test_optional_groups_in_patterns_are_exact(backend: str, pattern: str) -> None:
    """xgrammar 0.2.8 compiles ``(...)?`` holding ``*`` / ``+`` in a schema pattern wrongly
    (``^(?:ab*)?a$`` accepted "ba"); the backend writes such groups ``{0,1}``."""
    import re

    from grammar_helpers import BYTE_VOCAB, grammar_accepts

    if backend == "outlines" and "|" in pattern:
        pytest.skip("outlines: no top-level alternation")
    schema = {"type": "string", "pattern": pattern}
    compiled = get_backend(backend)(BYTE_VOCAB).compile(
        Constraint("json_schema", json.dumps(schema))
    )
    for text in ["ba", "a", "aba", "abba", "bba", "b@a", "bb@aa", "x", "xy", "xyy", ""]:
        accepted = grammar_accepts(compiled.new_matcher(), json.dumps(text))
        assert accepted == bool(re.search(pattern, text)), (pattern, text)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", ["ab", "^ab", "ab$", "^ab$", "^(?:a|b)c", "a|b", "^$", "",
                                     r"\\$", r"^\d+", r"[$^]x"])  # fmt: skip
def test_schema_patterns_are_searched(backend: str, pattern: str) -> None:
    """JSON Schema searches a ``pattern`` (unanchored); xgrammar 0.2.8 and outlines match it in
    full (xgrammar's issue #838), so their backends get ``patterns.as_full_match`` of each:
    the strings accepted are those ``jsonschema`` finds valid (but strings with an escape,
    which xgrammar never spells under a pattern and outlines' wildcard leaves out)."""
    import jsonschema
    from grammar_helpers import BYTE_VOCAB, grammar_accepts

    if backend == "outlines" and ("|" in pattern or "\\\\" in pattern):
        pytest.skip("outlines: no top-level alternation, nothing matching a backslash")
    schema = {"type": "string", "pattern": pattern}
    compiled = get_backend(backend)(BYTE_VOCAB).compile(
        Constraint("json_schema", json.dumps(schema))
    )
    texts = ["ab", "xab", "abx", "xabx", "a", "b", "c", "ac", "bc", "xbc", "bcx", "", "12", "x1",
             "$", "x$", "$x", "^x", "\\", "a\\$"]  # fmt: skip
    for text in texts:
        if backend != "llguidance" and json.dumps(text) != f'"{text}"':
            continue  # no escape in a string under a pattern (stricter)
        accepted = grammar_accepts(compiled.new_matcher(), json.dumps(text))
        valid = jsonschema.Draft202012Validator(schema).is_valid(text)
        assert accepted == valid, (pattern, text)


def test_validate_and_compile_normalize_a_schema_once(
    backends: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``check_schema`` (validate) and the backend's grammar (compile) prepare the same text:
    one normalization, whichever way each passes ``lower``."""
    import radixlm.runtime.grammar.strict as strict

    calls: list[Any] = []
    real = strict.normalize_schema
    monkeypatch.setattr(strict, "normalize_schema", lambda s: calls.append(s) or real(s))
    schema = {"title": "normalized once", "properties": {"n": {"type": "integer"}}}
    c = Constraint.from_params(json_schema=schema)  # a text no other test prepares
    assert c is not None
    backends["llguidance"].validate(c)
    backends["llguidance"].compile(c)
    assert len(calls) == 1


def _enforced(backend: str, pattern: str, invalid: str, valid: str) -> None:
    """`backend` accepts the pattern in strict mode and its grammar rejects `invalid` (written
    with and without `\\u` escapes) and accepts `valid`, as jsonschema says."""
    schema = {"type": "string", "pattern": pattern}
    validator = jsonschema.Draft202012Validator(schema)
    assert not validator.is_valid(invalid) and validator.is_valid(valid)
    c = Constraint.from_params(json_schema=schema)
    assert c is not None
    impl = get_backend(backend)(BYTE_VOCAB)
    impl.validate(c)
    compiled = impl.compile(c)
    for ensure_ascii in (True, False):
        text = json.dumps(invalid, ensure_ascii=ensure_ascii)
        assert not grammar_accepts(compiled.new_matcher(), text), (backend, text)
    assert grammar_accepts(compiled.new_matcher(), json.dumps(valid)), backend


# llguidance lets a negated class's excluded quote or backslash through as its JSON escape
# (measured: `[^"]` admitted `\\"`): such classes reach it as positive ones (`exact_patterns`).
@pytest.mark.parametrize(
    ("pattern", "invalid", "valid"),
    [('^[^"]*$', 'a"b', "a\\b"), ("^[^\\\\]*$", "a\\b", 'a"b'), ("^a[^<\\\\]$", "a\\", "a>")],
)
def test_negated_quote_and_backslash_classes_are_exact_on_llguidance(
    pattern: str, invalid: str, valid: str
) -> None:
    for backend in ("llguidance", "auto"):
        _enforced(backend, pattern, invalid, valid)


# xgrammar's negated classes are exact only for ASCII exclusions (measured: `[^é]` admitted
# `\\u00e9`, `\\S` admitted U+00A0, white space for jsonschema): refused there, enforced by
# `auto` through llguidance.
@pytest.mark.parametrize(
    ("pattern", "invalid", "valid"),
    [("^[^\u00e9]*$", "\u00e9", "e"), ("^\\S*$", "\u00a0", "a")],
)
def test_non_ascii_negations_are_refused_on_xgrammar_and_enforced_by_auto(
    pattern: str, invalid: str, valid: str
) -> None:
    c = Constraint.from_params(json_schema={"type": "string", "pattern": pattern})
    assert c is not None
    with pytest.raises(GrammarError, match=r"exact only for excluded ASCII characters"):
        get_backend("xgrammar")(BYTE_VOCAB).validate(c)
    _enforced("auto", pattern, invalid, valid)


@pytest.mark.parametrize("pattern", ["^\\W*$", "^[^\\d]+$", "^[a\\D]$"])
def test_unicode_class_negations_are_refused_everywhere(pattern: str) -> None:
    """jsonschema reads `\\w` / `\\d` over Unicode (é is a word character), the backends over
    ASCII: their negations would let through what jsonschema excludes."""
    c = Constraint.from_params(json_schema={"type": "string", "pattern": pattern})
    assert c is not None
    for name in ("auto", *BACKENDS):
        with pytest.raises(GrammarError, match="Unicode"):
            get_backend(name)(BYTE_VOCAB).validate(c)
