"""Proving that every instance one JSON schema accepts, another accepts too (``a`` ⊆ ``b``).

The normalizer uses it where a conjunction ``a and b`` is ``a`` exactly when ``a`` ⊆ ``b``
(a declared property under a ``patternProperties`` pattern that matches every name). The
proof is sound, not complete: ``False`` means "not proven".

Rules:

- ``b`` is ``true`` / ``{}``, ``a`` is ``false``, or the two are equal annotations aside;
- ``a`` is finite (``const`` / ``enum``) and ``b`` accepts each value (``jsonschema`` itself);
- ``a`` is a ``$ref`` (its target), an ``anyOf`` / ``oneOf`` (each branch ⊆ ``b``), or has an
  ``allOf`` member / ``$ref`` target ⊆ ``b`` (it is a subset of each);
- ``b`` is a conjunction: ``a`` ⊆ each of its own keyword sets, ``$ref`` target and ``allOf``
  member, and for each ``anyOf`` some branch contains ``a`` (for ``oneOf``: one branch contains
  it and the others are proven disjoint from it);
- keyword by keyword, for each instance type ``a`` allows: ``b``'s bound no looser than ``a``'s
  (types, lengths, ranges, item / property counts), the same ``pattern`` / ``format``, items
  and properties ⊆ recursively, ``b``'s ``required`` among ``a``'s.

Recursive schemas: a pair of references met again below an object property or array item is
taken as proven (coinduction; sound because instances are finite trees).
"""

from __future__ import annotations

import math
from typing import Any

from radixlm.runtime.grammar.disjoint import DisjointChecker, json_equal
from radixlm.runtime.grammar.patterns import regex_matches
from radixlm.runtime.grammar.schema_keywords import is_number, strip_annotations

_MAX_DEPTH = 48
_TYPES = ("null", "boolean", "object", "array", "string", "number", "integer")
_STRING = ("minLength", "maxLength", "pattern", "format")
_NUMBER = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ARRAY = ("items", "minItems", "maxItems", "uniqueItems")
_OBJECT = ("properties", "required", "additionalProperties", "patternProperties",
           "minProperties", "maxProperties")  # fmt: skip
_UNDERSTOOD = frozenset({"type", "enum", "const", *_STRING, *_NUMBER, *_ARRAY, *_OBJECT})
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")


class SubsetChecker:
    """Subset proofs for subschemas of one root schema (whose local ``$ref`` s resolve)."""

    def __init__(self, root: Any) -> None:
        self.disjoint = DisjointChecker(root)
        self._open: dict[tuple[int, int], int] = {}  # reference pairs being proven -> level

    def subset(self, a: Any, b: Any, depth: int = 0, level: int = 0) -> bool:
        """True only if every JSON value valid against ``a`` is valid against ``b``.
        ``level`` counts the instance levels (properties, items) descended so far."""
        if b is True or b == {} or a is False:
            return True
        if a is True or b is False or depth > _MAX_DEPTH:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        if json_equal(strip_annotations(a), strip_annotations(b)):
            return True
        values = DisjointChecker._values(a)
        if values is not None:
            return all(self.disjoint._accepts(b, v) for v in values)
        key = (id(a), id(b))
        if key in self._open:  # met again: proven if an instance level was descended since
            return level > self._open[key]
        self._open[key] = level
        try:
            return self._subset(a, b, depth, level)
        finally:
            del self._open[key]

    def _subset(self, a: dict[str, Any], b: dict[str, Any], depth: int, level: int) -> bool:
        d = depth + 1
        if "$ref" in a:
            target = self.disjoint.resolve(a["$ref"])
            if target is None:
                return False
            if self.disjoint._ref_alone or not any(k in _COMBINATORS or k in _UNDERSTOOD
                                                   for k in a if k != "$ref"):  # fmt: skip
                return self.subset(target, b, d, level)
            if self.subset(target, b, d, level):
                return True
        for key in ("anyOf", "oneOf"):
            if isinstance(a.get(key), list) and all(self.subset(m, b, d, level) for m in a[key]):
                return True
        if any(self.subset(m, b, d, level) for m in a.get("allOf") or []):
            return True
        if any(k in a for k in _COMBINATORS) or any(
            k not in _UNDERSTOOD and k in _VALIDATION for k in a
        ):
            return False  # a's own keywords alone may admit more than a
        return self._within(a, b, d, level)

    def _within(self, a: dict[str, Any], b: dict[str, Any], depth: int, level: int) -> bool:
        """``a`` (plain keywords) ⊆ ``b`` (any schema, split into its conjuncts)."""
        if "$ref" in b:
            target = self.disjoint.resolve(b["$ref"])
            if target is None or not self.subset(a, target, depth, level):
                return False
            if self.disjoint._ref_alone:
                return True
        for m in b.get("allOf") or []:
            if not self.subset(a, m, depth, level):
                return False
        if isinstance(b.get("anyOf"), list):
            if not any(self.subset(a, m, depth, level) for m in b["anyOf"]):
                return False
        if isinstance(b.get("oneOf"), list) and not self._in_one_of(a, b["oneOf"], depth, level):
            return False
        own = {k: v for k, v in b.items() if k not in _COMBINATORS}
        return self._keywords(a, own, depth, level)

    def _in_one_of(self, a: dict[str, Any], branches: list[Any], depth: int, level: int) -> bool:
        for i, m in enumerate(branches):
            if self.subset(a, m, depth, level):
                return all(self.disjoint.disjoint(a, o) for j, o in enumerate(branches) if j != i)
        return False

    # ---- keyword by keyword --------------------------------------------------------------------

    def _keywords(self, a: dict[str, Any], b: dict[str, Any], depth: int, level: int) -> bool:
        if any(k not in _UNDERSTOOD and k in _VALIDATION for k in b):
            return False
        if "enum" in b or "const" in b:
            return False  # a is not finite (handled before): not provable here
        types_a = _types(a.get("type"))
        if "type" in b:
            types_b = _types(b["type"])
            if any(t not in types_b and not (t == "integer" and "number" in types_b)
                   for t in types_a):  # fmt: skip
                return False
        if "string" in types_a and not _strings(a, b):
            return False
        if ("number" in types_a or "integer" in types_a) and not _numbers(a, b):
            return False
        if "array" in types_a and not self._arrays(a, b, depth, level):
            return False
        return "object" not in types_a or self._objects(a, b, depth, level)

    def _arrays(self, a: dict[str, Any], b: dict[str, Any], depth: int, level: int) -> bool:
        if not _at_least(a, b, "minItems") or not _at_most(a, b, "maxItems"):
            return False
        if b.get("uniqueItems") is True and a.get("uniqueItems") is not True:
            return False
        if isinstance(a.get("items"), list) or isinstance(b.get("items"), list):
            return False  # array-form items: not compared
        if "prefixItems" in a or "prefixItems" in b:
            return False
        return self.subset(a.get("items", True), b.get("items", True), depth, level + 1)

    def _objects(self, a: dict[str, Any], b: dict[str, Any], depth: int, level: int) -> bool:
        if not _at_least(a, b, "minProperties") or not _at_most(a, b, "maxProperties"):
            return False
        req_a = set(a.get("required") or [])
        if any(n not in req_a for n in b.get("required") or []):
            return False
        if "patternProperties" in a:
            return False
        props_a: dict[str, Any] = a.get("properties") or {}
        props_b: dict[str, Any] = b.get("properties") or {}
        extra_a = a.get("additionalProperties", True)
        extra_b = b.get("additionalProperties", True)
        patterns_b: dict[str, Any] = b.get("patternProperties") or {}
        if patterns_b and extra_a is not False:
            return False  # undeclared names of a may match b's patterns
        up = level + 1
        for name, schema in props_a.items():
            if schema is False:
                continue
            verdicts = {p: regex_matches(p, name) for p in patterns_b}
            if None in verdicts.values():
                return False
            targets = [patterns_b[p] for p, hit in verdicts.items() if hit]
            if name in props_b:
                targets.append(props_b[name])
            elif not targets:
                targets.append(extra_b)
            if not all(self.subset(schema, t, depth, up) for t in targets):
                return False
        for name, schema in props_b.items():
            if name not in props_a and not self.subset(extra_a, schema, depth, up):
                return False
        return extra_a is False or self.subset(extra_a, extra_b, depth, up)


_VALIDATION = frozenset(
    {*_UNDERSTOOD, "propertyNames", "dependentRequired", "dependentSchemas", "dependencies",
     "unevaluatedProperties", "prefixItems", "additionalItems", "contains", "minContains",
     "maxContains", "unevaluatedItems", "not", "if", "then", "else", "$dynamicRef",
     "$recursiveRef"}
)  # fmt: skip


def _types(t: Any) -> tuple[str, ...]:
    if isinstance(t, str):
        return (t,)
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return tuple(t)
    return _TYPES


def _at_least(a: dict[str, Any], b: dict[str, Any], key: str) -> bool:
    """``a``'s lower bound ``key`` is at least ``b``'s (absent: 0 / no bound)."""
    if key not in b:
        return True
    return is_number(a.get(key)) and is_number(b[key]) and a[key] >= b[key]


def _at_most(a: dict[str, Any], b: dict[str, Any], key: str) -> bool:
    if key not in b:
        return True
    return is_number(a.get(key)) and is_number(b[key]) and a[key] <= b[key]


def _strings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    for key in ("pattern", "format"):
        if key in b and not (key in a and a[key] == b[key]):
            return False
    return _at_least(a, b, "minLength") and _at_most(a, b, "maxLength")


def _numbers(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if "multipleOf" in b:
        ma, mb = a.get("multipleOf"), b["multipleOf"]
        # Integers only: jsonschema's float arithmetic breaks "a multiple of a multiple"
        # (1e308 is a multiple of 2 but, for it, not of 0.0001).
        ints = all(isinstance(m, int) and not isinstance(m, bool) and m > 0 for m in (ma, mb))
        if not (ints and ma % mb == 0):
            return False
    lo_a, lox_a, hi_a, hix_a = DisjointChecker._bounds(a)
    lo_b, lox_b, hi_b, hix_b = DisjointChecker._bounds(b)
    low_ok = lo_b == -math.inf or lo_a > lo_b or (lo_a == lo_b and (lox_a or not lox_b))
    high_ok = hi_b == math.inf or hi_a < hi_b or (hi_a == hi_b and (hix_a or not hix_b))
    return low_ok and high_ok
