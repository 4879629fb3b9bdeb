"""Facts about single JSON-schema objects that the normalizer's rewrites rely on: the exact
negation of a schema (as cases), the finite value set a schema allows, type intersections.
Each function is pure and exact, or answers None / False where it cannot be."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.grammar.disjoint import _value_type, json_equal
from radixlm.runtime.grammar.patterns import names_except, pattern_complement
from radixlm.runtime.grammar.schema_keywords import NON_ASSERTING, is_number

JSON_TYPES = ("null", "boolean", "object", "array", "number", "string")
MAX_NOT_CASES = 8


def negation(n: Any) -> list[list[Any]] | None:
    """``not n`` as a disjunction of conjunctions (cases of schemas to intersect), or None when
    it has no exact form here. Handled: ``{}`` / ``true`` (nothing), ``false`` (anything),
    ``required`` (an object, one listed property absent), ``type`` (the other types),
    ``pattern`` of one character class (a string of the complement, ``pattern_complement``),
    ``enum`` / ``const`` of strings only (a non-string, or a string that is none of them:
    ``names_except``), ``anyOf`` (every member negated), ``allOf`` and several keywords (one
    of them negated)."""
    if n is True:
        return []
    if n is False:
        return [[]]
    if not isinstance(n, dict):
        return None
    keys = [k for k in n if k not in NON_ASSERTING and not asserts_nothing(k, n[k])]
    if not keys:
        return []
    if len(keys) > 1:  # not (A and B) == not A or not B, one keyword each
        parts = [negation({k: n[k]}) for k in keys]
        if any(p is None for p in parts):
            return None
        cases = [c for p in parts for c in p if p is not None]
        return cases if len(cases) <= MAX_NOT_CASES else None
    (key,) = keys
    value = n[key]
    if key == "required" and isinstance(value, list):
        # non-objects satisfy `required`, so they fail its negation
        return [[{"type": "object", "properties": {name: False}}] for name in dict.fromkeys(value)]
    if key == "pattern" and isinstance(value, str):  # non-strings match any pattern
        other = pattern_complement(value)
        return None if other is None else [[{"type": "string", "pattern": other}]]
    if key in ("enum", "const"):
        values = value if key == "enum" else [value]
        if not isinstance(values, list) or not values:
            return None
        if not all(isinstance(v, str) for v in values):
            return None  # other values have no "every value but these" form here
        others = [t for t in JSON_TYPES if t != "string"]
        return [[{"type": others}], [{"type": "string", "pattern": names_except(values)}]]
    if key == "type":
        types = set(value) if isinstance(value, list) else {value}
        if "integer" in types and "number" not in types:
            return None  # "non-integer numbers" has no type
        rest = [t for t in JSON_TYPES if t not in types]
        return [[{"type": rest}]] if rest else []
    if key == "allOf" and isinstance(value, list):
        parts = [negation(m) for m in value]
        if any(p is None for p in parts):
            return None
        cases = [c for p in parts for c in p if p is not None]
        return cases if len(cases) <= MAX_NOT_CASES else None
    if key == "anyOf" and isinstance(value, list):
        out: list[list[Any]] = [[]]
        for m in value:  # not (A or B) == not A and not B: the cross product of their cases
            p = negation(m)
            if p is None or len(out) * len(p) > MAX_NOT_CASES:
                return None
            out = [a + b for a in out for b in p]
        return out
    return None


def asserts_nothing(key: str, value: Any) -> bool:
    """``properties`` of any-value schemas (``_declare_required`` adds those) and an any-value
    ``additionalProperties`` / ``items`` constrain nothing."""
    if key == "properties" and isinstance(value, dict):
        return all(v is True or v == {} for v in value.values())
    return key in ("additionalProperties", "items") and (value is True or value == {})


def required_and_forbidden(s: Any) -> bool:
    """A schema object requiring a property whose schema is ``false`` (matches no object)."""
    if not isinstance(s, dict) or s.get("type") != "object":
        return False
    props = s.get("properties", {})
    required = s.get("required", [])
    return (
        isinstance(props, dict)
        and isinstance(required, list)
        and any(props.get(n) is False for n in required)
    )


def type_spec(t: Any) -> bool:
    return isinstance(t, str) or (isinstance(t, list) and all(isinstance(x, str) for x in t))


def intersect_types(a: Any, b: Any) -> list[str]:
    ta = [a] if isinstance(a, str) else list(a) if isinstance(a, list) else []
    tb = [b] if isinstance(b, str) else list(b) if isinstance(b, list) else []
    out = [t for t in ta if t in tb or (t == "integer" and "number" in tb)]
    out += [t for t in tb if t == "integer" and "number" in ta and t not in out]
    return out


def finite_values(s: Any) -> list[Any] | None:
    """The values a schema allows, when it is a plain ``const`` / ``enum`` / boolean type."""
    if not isinstance(s, dict):
        return None
    keys = {k for k in s if k not in NON_ASSERTING}
    if keys == {"const"} or keys == {"const", "type"} and type_ok(s, [s["const"]]):
        return [s["const"]]
    if (keys == {"enum"} or keys == {"enum", "type"}) and isinstance(s["enum"], list):
        vals = [v for i, v in enumerate(s["enum"]) if not any(
            json_equal(v, w) for w in s["enum"][:i])]  # fmt: skip
        return vals if keys == {"enum"} or type_ok(s, vals) else None
    if keys == {"type"} and s["type"] == "boolean":
        return [True, False]
    return None


def type_ok(s: dict[str, Any], values: list[Any]) -> bool:
    """Every value has the schema's (single) type, so ``type`` removes none of them."""
    t = s.get("type")
    return isinstance(t, str) and all(
        _value_type(v) == t
        or (t == "integer" and is_number(v) and float(v).is_integer())
        or (t == "number" and _value_type(v) == "number")
        for v in values
    )
