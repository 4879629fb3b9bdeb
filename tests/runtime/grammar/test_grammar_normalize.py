"""Schema normalization: each rewrite keeps the set of valid instances (checked with
``jsonschema`` on the original and the rewritten schema), turns a schema strict mode refused
into one it accepts, and the compiled grammar accepts exactly the valid instances listed.
Also the ``oneOf`` disjointness prover."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from grammar_helpers import BACKENDS, BYTE_VOCAB, grammar_accepts

from radixlm.runtime.grammar.base import GrammarBackend, get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.disjoint import DisjointChecker
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.normalize import lower_for_backends, normalize_schema
from radixlm.runtime.grammar.strict import (
    DRAFT_2020_12,
    XGRAMMAR_SUPPORT,
    find_unsupported,
    prepared_schema_text,
)
from radixlm.runtime.grammar.strict import (
    LLGUIDANCE_SUPPORT as LLG,
)
from radixlm.runtime.grammar.verified import VerifiedGrammar

DRAFT7 = "http://json-schema.org/draft-07/schema#"
OBJ = {"type": "object"}

# name -> (schema, instances; each written in the schema's property order)
CASES: dict[str, tuple[dict[str, Any], list[Any]]] = {
    "not required (one property absent)": (
        {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
         "not": {"required": ["a", "b"]}},
        [{}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}, {"a": "x"}],
    ),
    "not anyOf of requireds": (
        {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {}},
         "not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}},
        [{}, {"a": 1}, {"b": 2}, {"c": 3}, {"a": 1, "b": 2}],
    ),
    "not {} forbids a property": (
        {**OBJ, "properties": {"a": {"type": "integer"}, "gone": {"not": {}}},
         "additionalProperties": False},
        [{}, {"a": 1}, {"gone": 1}, {"a": 1, "gone": None}],
    ),
    "not type": (
        {**OBJ, "properties": {"v": {"not": {"type": ["number", "string"]}}}, "required": ["v"]},
        [{"v": 1}, {"v": 1.5}, {"v": "s"}, {"v": None}, {"v": True}, {"v": [1]}, {"v": {}}],
    ),
    "oneOf of requireds (overlapping)": (
        {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
         "additionalProperties": False, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        [{}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}],
    ),
    "oneOf of types and requireds": (
        {"oneOf": [{"type": "string"}, {"required": ["a"]}],
         "anyOf": [{"type": "string"}, {**OBJ, "properties": {"a": {"type": "integer"}},
                                        "additionalProperties": False}]},
        ["s", {}, {"a": 1}, 3],
    ),
    "not pattern of one class": (
        {"type": "string", "not": {"pattern": "^[\\s.,-]+$"}},
        ["a", " ", ".,", "", " a", " \n", "x\n", "-\u3000"],
    ),
    "allOf merged": (
        {
            "allOf": [
                {**OBJ, "properties": {"a": {"type": "integer", "minimum": 0}}, "required": ["a"]},
                {"properties": {"a": {"maximum": 10}, "b": {"type": "string"}},
                 "additionalProperties": False},
            ]
        },
        [{"a": 5}, {"a": 5, "b": "x"}, {"a": 11}, {"a": -1}, {}, {"a": 1, "c": 1}, {"b": "x"}],
    ),
    "allOf with a $ref inlined": (
        {
            "$defs": {"base": {**OBJ, "properties": {"id": {"type": "integer"}},
                               "required": ["id"]}},
            "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"name": {"type": "string"}}}],
        },
        [{"id": 1}, {"id": 1, "name": "x"}, {"name": "x"}, {"id": "x"}],
    ),
    "dependentRequired": (
        {
            **OBJ,
            "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
            "dependentRequired": {"card": ["billing"]},
        },
        [{}, {"card": "1"}, {"card": "1", "billing": "x"}, {"billing": "x"}],
    ),
    "draft-07 dependencies": (
        {
            "$schema": DRAFT7,
            **OBJ,
            "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
            "dependencies": {"card": ["billing"], "billing": {"required": ["card"]}},
        },
        [{}, {"card": "1"}, {"card": "1", "billing": "x"}, {"billing": "x"}],
    ),
    "if/then/else on an enum property": (
        {
            **OBJ,
            "properties": {
                "kind": {"enum": ["a", "b", "c"]},
                "x": {"type": "integer"},
                "y": {"type": "string"},
            },
            "required": ["kind"],
            "if": {"properties": {"kind": {"const": "a"}}},
            "then": {"required": ["x"]},
            "else": {"required": ["y"]},
        },
        [{"kind": "a", "x": 1}, {"kind": "a"}, {"kind": "b", "y": "s"}, {"kind": "b", "x": 1},
         {"kind": "c", "x": 1, "y": "s"}, {"kind": "d", "y": "s"}],
    ),
    "if on a required property": (
        {
            **OBJ,
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "if": {"required": ["a"]},
            "then": {"required": ["b"]},
        },
        [{}, {"a": 1}, {"a": 1, "b": 2}, {"b": 2}],
    ),
    "uniqueItems over a finite set": (
        {"type": "array", "items": {"enum": ["r", "g", "b"]}, "uniqueItems": True, "maxItems": 2},
        [[], ["r"], ["r", "g"], ["g", "r"], ["r", "r"], ["r", "g", "b"], ["x"]],
    ),
    "draft-07 items array and additionalItems": (
        {
            "$schema": DRAFT7,
            "type": "array",
            "items": [{"type": "integer"}, {"type": "string"}],
            "additionalItems": False,
        },
        [[1, "a"], [1], [1, "a", 2], ["a"]],
    ),
    "required but undeclared": (
        {
            **OBJ,
            "properties": {"a": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": {"type": "string"},
        },
        [{"a": 1, "b": "x"}, {"a": 1}, {"a": 1, "b": 2}],
    ),
    "enum with type": (
        {"type": "string", "enum": ["a", 1, "b"]},
        ["a", 1, "b", "c"],
    ),
    "anyOf with sibling keywords": (
        {
            **OBJ,
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "additionalProperties": False,
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
        [{}, {"a": 1}, {"b": 1}, {"a": 1, "b": 2}, {"c": 1}],
    ),
    # The issue's example: "linux" matches both branches, so it is the one string not allowed.
    "oneOf of a string and a string enum": (
        {**OBJ, "properties": {"os": {"oneOf": [{"type": "string"}, {"enum": ["linux"]}]}},
         "required": ["os"], "additionalProperties": False},
        [{"os": v} for v in ("linux", "linu", "linuxx", "", "Linux", "li\nnux", "x", 3, None)],
    ),
    "not of string consts": (
        {"type": "string", "not": {"enum": ["a", "ab", "a\"b", "b\\"]}},
        ["a", "ab", 'a"b', "b\\", "", "b", "abc", "a\n", "e", "b\\\\", 'a"', 5],
    ),
    "oneOf with a discriminator": (
        {
            "oneOf": [
                {**OBJ, "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                 "required": ["kind", "r"], "additionalProperties": False},
                {**OBJ, "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                 "required": ["kind", "side"], "additionalProperties": False},
            ]
        },
        [{"kind": "circle", "r": 1}, {"kind": "square", "side": 2}, {"kind": "circle", "side": 2}],
    ),
}  # fmt: skip
# outlines generates exactly the prefixItems (no shorter arrays): over-strict, never invalid.
# xgrammar's string patterns never match an escaped control character ("x\n" is refused).
OVER_STRICT = {("outlines", "draft-07 items array and additionalItems"),
               ("xgrammar", "not pattern of one class"),
               ("xgrammar", "oneOf of a string and a string enum"),
               ("xgrammar", "not of string consts"),
               # positive classes without control characters ("a\n" refused)
               ("llguidance", "not of string consts")}  # fmt: skip
# Cases whose original form strict mode accepted before (no normalization needed).
ALREADY_ACCEPTED = {"oneOf with a discriminator"}


def _valid(schema: Any, instance: Any) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return bool(cls(schema).is_valid(instance))


def _valid_normalized(schema: Any, instance: Any) -> bool:
    """The normalized form writes array tuples as 2020-12 does (``prefixItems`` / ``items``)."""
    if isinstance(schema, dict) and "prefixItems" in schema and schema.get("$schema") == DRAFT7:
        schema = {k: v for k, v in schema.items() if k != "$schema"}
    return _valid(schema, instance)


@pytest.fixture(scope="module")
def byte_backends() -> dict[str, GrammarBackend]:
    return {name: get_backend(name)(BYTE_VOCAB) for name in BACKENDS}


@pytest.mark.parametrize("name", list(CASES))
def test_rewrite_is_exact_and_enforced(name: str, byte_backends: dict[str, GrammarBackend]) -> None:
    schema, instances = CASES[name]
    normalized = normalize_schema(schema)
    lowered = json.loads(prepared_schema_text(json.dumps(schema)))
    expected = lower_for_backends(normalized)
    if isinstance(expected, dict) and "$schema" in expected:
        expected = {**expected, "$schema": DRAFT_2020_12}
    assert lowered == expected
    for instance in instances:
        assert _valid(schema, instance) == _valid_normalized(normalized, instance), instance
    if name not in ALREADY_ACCEPTED:
        assert find_unsupported(schema, XGRAMMAR_SUPPORT), "the original was refused before"
    assert [] in (find_unsupported(lowered, XGRAMMAR_SUPPORT), find_unsupported(lowered, LLG))
    c = Constraint.from_params(json_schema=schema)
    assert c is not None
    for backend_name, backend in byte_backends.items():
        support = backend.schema_support
        prepared = json.loads(
            prepared_schema_text(json.dumps(schema), support.declared_properties_only)
        )
        if find_unsupported(prepared, support):
            with pytest.raises(GrammarError):
                backend.validate(c)
            continue
        compiled = backend.compile(c)
        for instance in instances:
            text = json.dumps(instance, separators=(",", ":"))
            accepted = grammar_accepts(compiled.new_matcher(), text)
            valid = _valid(schema, instance)
            assert valid or not accepted, (backend_name, instance)  # never invalid
            if (backend_name, name) not in OVER_STRICT:
                assert accepted == valid, (backend_name, instance)


def test_one_of_overlap_without_an_exact_negation_is_verified(
    byte_backends: dict[str, Any],
) -> None:
    """`maxLength` has no exact negation here and the branches cannot be narrowed apart: the
    grammar gets their ``anyOf`` and the verifier checks "exactly one"."""
    branches = [{"type": "string"}, {"type": "string", "maxLength": 3}]
    schema = {**OBJ, "properties": {"os": {"oneOf": branches}}}
    c = Constraint.from_params(json_schema=schema)
    assert c is not None
    for name, backend in byte_backends.items():
        if name == "outlines":
            continue  # generic strings under anyOf: seconds of DFA building
        compiled = backend.compile(c)
        assert isinstance(compiled, VerifiedGrammar)
        assert not grammar_accepts(compiled.new_matcher(), '{"os":"ab"}')
        assert grammar_accepts(compiled.new_matcher(), '{"os":"abcd"}')


@pytest.mark.parametrize(
    ("a", "b", "disjoint"),
    [
        ({"type": "string"}, {"type": "integer"}, True),
        ({"type": "number"}, {"type": "integer"}, False),
        ({"type": "string"}, {"enum": ["linux"]}, False),
        ({"type": "string"}, {"enum": [1, None]}, True),
        ({"const": 1}, {"const": 1.0}, False),
        ({"const": True}, {"const": 1}, True),
        ({"type": "integer", "maximum": 3}, {"type": "integer", "minimum": 4}, True),
        ({"type": "integer", "maximum": 3}, {"type": "number", "minimum": 3}, False),
        ({"type": "number", "exclusiveMaximum": 3}, {"type": "number", "minimum": 3}, True),
        (
            {**OBJ, "properties": {"k": {"const": "a"}}, "required": ["k"]},
            {**OBJ, "properties": {"k": {"const": "b"}}, "required": ["k"]},
            True,
        ),
        (  # "k" is not required: {} matches both
            {**OBJ, "properties": {"k": {"const": "a"}}},
            {**OBJ, "properties": {"k": {"const": "b"}}},
            False,
        ),
        (
            {**OBJ, "properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
            {**OBJ, "properties": {"b": {}}, "required": ["b"], "additionalProperties": False},
            True,
        ),
        (  # no type: non-objects match both
            {"properties": {"k": {"const": "a"}}, "required": ["k"]},
            {"properties": {"k": {"const": "b"}}, "required": ["k"]},
            False,
        ),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, {"type": "integer"}, True),
        ({"allOf": [{"type": "string"}]}, {"type": "integer"}, True),
    ],
)
def test_disjointness_prover(a: Any, b: Any, disjoint: bool) -> None:
    checker = DisjointChecker({})
    assert checker.disjoint(a, b) == disjoint
    assert checker.disjoint(b, a) == disjoint


def test_draft7_ref_hides_siblings_in_the_prover() -> None:
    defs = {"definitions": {"s": {"type": "string"}}}
    ref_and_type = {"$ref": "#/definitions/s", "type": "integer"}
    # Draft 7 ignores "type" beside "$ref": the schema accepts every string.
    draft7 = DisjointChecker({"$schema": DRAFT7, **defs})
    assert not draft7.disjoint(ref_and_type, {"type": "string"})
    # 2020-12 applies both: nothing is a string and an integer.
    assert DisjointChecker(defs).disjoint(ref_and_type, {"type": "string"})


# (backend, schema, refusal named, an invalid instance the best-effort grammar accepts): each
# refusal is warranted, the backend really ignores the keyword there.
SILENT_IGNORES = [
    ("xgrammar", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3},
     "minLength (with pattern)", "ab"),
    ("xgrammar", {"type": "string", "format": "duration", "maxLength": 5},
     "maxLength (with format)", "P1Y2M3D"),
    ("xgrammar", {"type": "string", "format": "date", "maxLength": 5},
     "maxLength (with pattern)", "2024-01-01"),
    ("xgrammar", {"type": "integer", "multipleOf": 3, "minimum": 1},
     "multipleOf (with minimum)", 4),
    ("xgrammar", {"type": "integer", "multipleOf": 1.5}, "multipleOf (not an integer)", 1),
    ("outlines", {"type": "string", "pattern": "^[a-z]+$", "minLength": 3},
     "pattern (with minLength)", "ABC"),
    ("xgrammar", {"type": "string", "allOf": [{"pattern": "^a$"}, {"pattern": "^b$"}]},
     "allOf (with sibling keywords)", "b"),
]  # fmt: skip


@pytest.mark.parametrize(("backend", "schema", "named", "invalid"), SILENT_IGNORES)
def test_silently_ignored_keywords_are_refused(
    backend: str, schema: Any, named: str, invalid: Any, byte_backends: dict[str, Any]
) -> None:
    assert not _valid(schema, invalid)
    c = Constraint.from_params(json_schema=schema)
    assert c is not None
    with pytest.raises(GrammarError) as err:
        byte_backends[backend].validate(c)
    assert named in str(err.value)
    lenient = Constraint.from_params(json_schema=schema, best_effort=True)
    assert lenient is not None
    compiled = byte_backends[backend].compile(lenient)
    assert grammar_accepts(compiled.new_matcher(), json.dumps(invalid, separators=(",", ":")))


def test_ref_siblings_and_draft4_bounds() -> None:
    draft4 = "http://json-schema.org/draft-04/schema#"
    old = {
        "$schema": draft4,
        "definitions": {"s": {"type": "string"}},
        "type": "object",
        "properties": {"x": {"$ref": "#/definitions/s", "maxLength": 3}},
        "additionalProperties": False,
    }
    # Before 2019-09 "maxLength" beside "$ref" does not apply: dropped.
    assert normalize_schema(old)["properties"]["x"] == {"$ref": "#/definitions/s"}
    assert _valid(old, {"x": "long string"})
    new = {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 3}
    assert normalize_schema(new) == {"$defs": {"s": {"type": "string"}}, "type": "string",
                                     "maxLength": 3}  # fmt: skip
    bound = {"$schema": draft4, "type": "integer", "minimum": 5, "exclusiveMinimum": True}
    assert normalize_schema(bound) == {"$schema": draft4, "type": "integer", "exclusiveMinimum": 5}


def test_implied_type_beside_refs_is_dropped_and_inner_dialects_too() -> None:
    a = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "$schema": DRAFT7,
        "definitions": {"a": a, "b": {"$schema": DRAFT7, "type": "string"}},
        "type": "object",
        "properties": {
            "v": {"type": ["object", "string"], "anyOf": [{"$ref": "#/definitions/a"},
                                                           {"$ref": "#/definitions/b"}]},
            "w": {"type": "object", "anyOf": [{"$ref": "#/definitions/a"}, {"minimum": 1}]},
        },
    }  # fmt: skip
    out = normalize_schema(schema)
    assert "type" not in out["properties"]["v"]  # every branch states a type within it
    assert "object" in json.dumps(out["properties"]["w"])  # a branch without a type: kept
    assert "$schema" not in out["definitions"]["b"] and out["$schema"] == DRAFT7
    for inst in [{"v": {"x": 1}}, {"v": "s"}, {"v": 3}, {"w": {}}, {"w": 2}]:
        assert _valid(schema, inst) == _valid(out, inst), inst


# A recursive object (its "kids" are the root again) and a non-recursive one inside it.
NODE = {"type": "object", "properties": {"kids": {"$ref": "#"}, "name": {"$ref": "#/$defs/label"}}}
LEAF = {"type": "object", "properties": {"name": {"$ref": "#/$defs/label"}}, "required": ["name"],
        "additionalProperties": False}  # fmt: skip
OVERLAP_DEFS = {"node": NODE, "leaf": LEAF, "label": {"type": "string", "maxLength": 3}}
PATTERN_OVERLAPS = {
    # the declared property's schema is the pattern's (annotations aside): -> {}
    "equal": (
        {"type": "object", "$defs": OVERLAP_DEFS,
         "patternProperties": {".*": {"$ref": "#/$defs/node"}},
         "properties": {"main": {"$ref": "#/$defs/node", "description": "the main node"}}},
        {"main": {}},
        [{"main": {"kids": {"a": {"name": "x"}}}}, {"main": {"kids": {"a": {"name": "long"}}}},
         {"other": {}}, {"other": 1}, {"main": 1}],
    ),
    # the declared property's schema is a proven subset of a pattern matching every name:
    # -> that pattern excludes the property's name
    "subset": (
        {"type": "object", "$defs": OVERLAP_DEFS,
         "patternProperties": {"^[a-z_]*": {"type": "array", "items": {
             "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}},
         "properties": {"redirect": {"type": "array", "maxItems": 1,
                                     "items": {"$ref": "#/$defs/leaf"}}}},
        {"redirect": {"type": "array", "maxItems": 1, "items": {"$ref": "#/$defs/leaf"}}},
        [{"redirect": [{"name": "x"}]}, {"redirect": [{"name": "long"}]}, {"redirect": [None]},
         {"redirect": []}, {"redirect": [{"name": "x"}, {"name": "y"}]}, {"redirect": [{}]},
         {"redirects": [None, {"name": "z"}]}, {"r": [{"kids": {}}]}, {"r": [1]}],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PATTERN_OVERLAPS))
def test_pattern_overlaps_with_recursive_refs(name: str, byte_backends: dict[str, Any]) -> None:
    """Declared properties under overlapping patterns whose schemas hold recursive ``$ref`` s
    (which llguidance cannot intersect): rewritten exactly, then enforced exactly."""
    import llguidance

    schema, props, instances = PATTERN_OVERLAPS[name]
    plain = llguidance.LLMatcher.grammar_from_json_schema(lower_for_backends(schema))
    assert llguidance.LLMatcher.validate_grammar(plain), "refused without the rewrite"
    normalized = normalize_schema(schema)
    assert normalized["properties"] == props
    if name == "subset":
        assert list(normalized["patternProperties"]) != list(schema["patternProperties"])
    for instance in instances:
        assert _valid(schema, instance) == _valid(normalized, instance), instance
    assert {_valid(schema, i) for i in instances} == {True, False}
    compiled = byte_backends["llguidance"].compile(Constraint.from_params(json_schema=schema))
    for instance in instances:
        text = json.dumps(instance, separators=(",", ":"))
        assert grammar_accepts(compiled.new_matcher(), text) == _valid(schema, instance), text


FIELD = {"type": "object", "additionalProperties": False}
MADE_DISJOINT = {
    # a discriminator that no branch requires: {"label": "x"} matches both (invalid)
    "discriminator not required": (
        {"oneOf": [
            {**FIELD, "properties": {"type": {"enum": ["text"]}, "label": {"type": "string"}},
             "required": ["label"]},
            {**FIELD, "properties": {"type": {"const": "static"}, "label": {"type": "string"}},
             "required": ["label"]}]},
        [{"label": "x"}, {"type": "text", "label": "x"}, {"type": "static", "label": "x"},
         {"type": "other", "label": "x"}, {"type": "text"}],
    ),
    # one optional key per branch, no "type": {} and 5 match every branch (invalid)
    "one key each": (
        {"oneOf": [{"properties": {"and": {"type": "integer"}}, "additionalProperties": False},
                   {"properties": {"or": {"type": "integer"}}, "additionalProperties": False}]},
        [{}, 5, {"and": 1}, {"or": 2}, {"and": 1, "or": 2}, {"and": "x"}],
    ),
    # arrays: [] matches both (invalid)
    "arrays of disjoint items": (
        {"oneOf": [{"type": "array", "items": {"type": "number"}},
                   {"type": "array", "items": {"type": "string"}}]},
        [[], [1], ["a"], [1, "a"], [None]],
    ),
    # booleans match both (the object branch has no "type"): the boolean branch is dropped
    "a branch inside another": (
        {"oneOf": [{"type": "boolean"},
                   {"properties": {"on": {"type": "boolean"}}, "additionalProperties": False}]},
        [True, False, {}, {"on": True}, {"on": 1}, 3],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MADE_DISJOINT))
def test_overlapping_one_of_is_made_disjoint(name: str, byte_backends: dict[str, Any]) -> None:
    """A ``oneOf`` whose branches overlap, with no exact rewrite: each branch is narrowed until
    it is proven disjoint from the others (over-strict), so nothing the grammar accepts fails
    ``jsonschema``, and it accepts some valid instances."""
    schema, instances = MADE_DISJOINT[name]
    assert find_unsupported(schema, XGRAMMAR_SUPPORT), "refused before"
    normalized = normalize_schema(schema)
    assert "oneOf" not in json.dumps(normalized)
    for instance in instances:
        if _valid(normalized, instance):
            assert _valid(schema, instance), instance
    assert any(_valid(normalized, i) for i in instances)
    c = Constraint.from_params(json_schema=schema)
    for backend_name in ("llguidance", "xgrammar"):
        compiled = byte_backends[backend_name].compile(c)
        accepted = [
            i for i in instances
            if grammar_accepts(compiled.new_matcher(), json.dumps(i, separators=(",", ":")))
        ]  # fmt: skip
        assert all(_valid(schema, i) for i in accepted), (backend_name, accepted)
        assert accepted, backend_name


def test_draft3_only_formats_are_annotations_in_later_drafts() -> None:
    """`color` (and the other draft-3-only formats) assert nothing under a later draft: dropped
    there, kept (and so enforced or refused) under draft 3."""
    later = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "string"}
    assert "format" not in normalize_schema({**later, "format": "color"})
    assert normalize_schema({**later, "format": "email"})["format"] == "email"
    draft3 = {"$schema": "http://json-schema.org/draft-03/schema#", "type": "string"}
    assert normalize_schema({**draft3, "format": "color"})["format"] == "color"
