"""``subsume.SubsetChecker``: proven subsets are subsets. Checked on hand-made pairs (true and
false ones) and, for soundness, on every pair of schemas from one file of the official
JSON-Schema-Test-Suite: where ``a`` ⊆ ``b`` is claimed, every suite instance that ``jsonschema``
finds valid under ``a`` must be valid under ``b``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixlm.runtime.grammar.subsume import SubsetChecker

SUITE = Path(__file__).resolve().parents[2] / "data" / "json_schema_test_suite" / "draft2020-12"

NODE = {"type": "object",
        "properties": {"child": {"$ref": "#/$defs/node"}, "v": {"type": "integer"}}}  # fmt: skip
LEAF = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0}},
        "required": ["v"], "additionalProperties": False}  # fmt: skip
DEFS = {"$defs": {"node": NODE, "leaf": LEAF, "tree": {
    "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
    "additionalProperties": False}}}  # fmt: skip

PAIRS: list[tuple[Any, Any, bool]] = [
    ({"type": "integer"}, {"type": "number"}, True),
    ({"type": "number"}, {"type": "integer"}, False),
    ({"type": "string", "minLength": 3}, {"type": "string", "minLength": 2}, True),
    ({"type": "string"}, {"type": "string", "minLength": 2}, False),
    ({"enum": ["a", "b"]}, {"type": "string", "maxLength": 1}, True),
    ({"enum": ["a", "bb"]}, {"type": "string", "maxLength": 1}, False),
    ({"type": "integer", "minimum": 1, "maximum": 5},
     {"type": "number", "exclusiveMinimum": 0}, True),
    ({"type": "integer", "minimum": 0}, {"type": "number", "exclusiveMinimum": 0}, False),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1},
     {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "null"}]}}, True),
    ({"type": "array"}, {"type": "array", "items": {"type": "integer"}}, False),
    ({"$ref": "#/$defs/leaf"}, {"$ref": "#/$defs/node"}, True),  # leaf declares only v >= 0
    ({"$ref": "#/$defs/node"}, {"$ref": "#/$defs/leaf"}, False),
    ({"$ref": "#/$defs/tree"}, {"$ref": "#/$defs/tree"}, True),
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}},
                                       "x": {}}, "additionalProperties": False},
     {"$ref": "#/$defs/tree"}, False),  # x is not allowed by tree
    ({"type": "object", "additionalProperties": False, "properties": {"a": {"const": 1}}},
     {"type": "object", "patternProperties": {"^a$": {"type": "integer"}}}, True),
    ({"type": "object"}, {"type": "object", "patternProperties": {"^a$": {"type": "integer"}}},
     False),
    ({"type": "object", "required": ["a"]}, {"type": "object", "required": ["a", "b"]}, False),
    ({"anyOf": [{"const": 1}, {"type": "string"}]}, {"type": ["integer", "string"]}, True),
    ({"type": "string"}, {"oneOf": [{"type": "string"}, {"type": "number"}]}, True),
    ({"type": "string"}, {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]},
     False),  # "ab" is in both branches
    ({"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "^a"}, True),
    ({"type": "string", "pattern": "^ab"}, {"type": "string", "pattern": "^a"},
     False),  # true, but not proven
    (True, {"type": "string"}, False),
    ({"type": "string"}, {}, True),
    (False, {"type": "string"}, True),
]  # fmt: skip


@pytest.mark.parametrize(("a", "b", "expected"), PAIRS)
def test_subset_pairs(a: Any, b: Any, expected: bool) -> None:
    root = {**DEFS, "anyOf": [a, b]}
    a, b = root["anyOf"]
    assert SubsetChecker(root).subset(a, b) is expected


def _suite_files() -> list[Path]:
    return sorted(SUITE.glob("*.json"))


@pytest.mark.parametrize("path", _suite_files(), ids=lambda p: p.stem)
def test_claimed_subsets_hold_on_suite_instances(path: Path) -> None:
    """Pairs of schemas from one suite file (references resolve only inside one schema, so a
    pair is checked where neither holds one): a claimed subset never has a counterexample."""
    groups = [g for g in json.loads(path.read_text()) if not _has_ref(g["schema"]) and _usable(g)]
    instances = [t["data"] for g in groups for t in g["tests"]]
    for ga in groups:
        for gb in groups:
            a, b = ga["schema"], gb["schema"]
            root = {"anyOf": [a, b]}
            if not SubsetChecker(root).subset(root["anyOf"][0], root["anyOf"][1]):
                continue
            va = jsonschema.Draft202012Validator(a)
            vb = jsonschema.Draft202012Validator(b)
            for x in instances:
                if va.is_valid(x):
                    assert vb.is_valid(x), (ga["description"], gb["description"], x)


def _usable(group: dict[str, Any]) -> bool:
    """jsonschema validates the group's instances (Python's ``re`` lacks some ECMA-262
    escapes, such as ``\\p{Letter}``)."""
    try:
        validator = jsonschema.Draft202012Validator(group["schema"])
        for t in group["tests"]:
            validator.is_valid(t["data"])
    except Exception:
        return False
    return True


def _has_ref(s: Any) -> bool:
    if isinstance(s, dict):
        return any(k in s for k in ("$ref", "$dynamicRef", "$id")) or any(
            _has_ref(v) for v in s.values()
        )
    return isinstance(s, list) and any(_has_ref(v) for v in s)
