"""Random JSON schemas that need the verifier: the keywords no grammar can express
(``uniqueItems``, ``not``, ``propertyNames``, lookaround ``pattern``, ``if`` / ``then`` /
``else``, overlapping ``oneOf``, ``contains``, ``unevaluatedProperties``) mixed with ordinary
ones (objects with required and optional properties, bounded arrays, enums, plain patterns,
nesting), small enough for a 135M model to fill in ~100 tokens.

``random_schema(rng)`` takes anything with ``random.Random``'s ``random`` / ``randint`` /
``choice`` / ``sample``: a seeded ``random.Random`` (``bench_verifier.py --random``) or
hypothesis' ``st.randoms(use_true_random=False)`` (the property test, which shrinks through
it). Every value's bounds keep outputs short; nothing here guarantees a schema is satisfiable
(an unsatisfiable part ends its request with ``grammar_dead_end``, as documented).
"""

from __future__ import annotations

from typing import Any, Protocol

NAMES = ("name", "size", "tags", "kind", "code", "count", "mode", "meta", "level", "label")
WORDS = ("red", "blue", "green", "gold", "teal", "gray", "pink")
PLAIN_PATTERNS = ("^[a-z]{1,6}$", "^[a-c][0-9]{1,2}$", "^(ab|ac|b|cd)$")
LOOKAROUND_PATTERNS = (
    "^(?!te)[a-z]{2,6}$",
    "^[a-z]{2,6}(?<!s)$",
    "^(?=[a-z]*[0-9])[a-z0-9]{2,6}$",
    "^(?!.*(.).*\\1)[a-f]{2,4}$",
)
MAX_DEPTH = 2


class Rng(Protocol):
    def random(self) -> float: ...
    def randint(self, a: int, b: int) -> int: ...
    def choice(self, seq: Any) -> Any: ...
    def sample(self, population: Any, k: int) -> list[Any]: ...


def random_schema(rng: Rng) -> dict[str, Any]:
    """A root object schema (see the module docstring)."""
    return _object(rng, 0)


def _object(rng: Rng, depth: int) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(1, 3))
    props = {n: _value(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6] or names[:1]
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}  # fmt: skip
    ints = [n for n in names if props[n].get("type") == "integer"]
    strings = [n for n in names if props[n].get("type") == "string"]
    keyword = rng.choice(["not", "if", "unevaluatedProperties", "minProperties", "", ""])
    if keyword == "not" and ints:  # a few values of a property forbidden at the root
        n = rng.choice(ints)
        lo = props[n]["minimum"] + rng.randint(0, 3)
        schema["not"] = {"properties": {n: {"minimum": lo, "maximum": lo + rng.randint(0, 5)}},
                         "required": [n]}  # fmt: skip
    elif keyword == "if" and ints:
        n, other = rng.choice(ints), rng.choice(names)
        schema["if"] = {"properties": {n: {"minimum": props[n]["minimum"] + rng.randint(0, 9)}}}
        schema["then"] = {"required": [other]}
        if rng.random() < 0.5 and strings:
            schema["else"] = {"properties": {rng.choice(strings): {"maxLength": 3}}}
    elif keyword == "unevaluatedProperties":
        extra = rng.choice([n for n in NAMES if n not in names])
        schema["allOf"] = [{"properties": {extra: {"type": "integer", "minimum": 0,
                                                   "maximum": 9}}}]  # fmt: skip
        del schema["additionalProperties"]
        schema["unevaluatedProperties"] = False
    elif keyword == "minProperties":
        schema["minProperties"] = min(len(names), 2)
    return schema


def _value(rng: Rng, depth: int) -> dict[str, Any]:
    kinds = ["integer", "string", "enum", "boolean", "array", "oneOf"]
    if depth < MAX_DEPTH:
        kinds += ["object", "map"]
    kind = rng.choice(kinds)
    if kind == "integer":
        return _integer(rng)
    if kind == "string":
        return _string(rng)
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "oneOf":
        lo, hi = rng.randint(0, 20), rng.randint(10, 40)
        return {"oneOf": [{"type": "integer", "minimum": 0, "maximum": hi},
                          {"type": "integer", "minimum": lo, "maximum": 60}]}  # fmt: skip
    if kind == "array":
        return _array(rng)
    if kind == "map":
        # a plain anchored name pattern is the grammar's (``relax``), a lookaround one the
        # verifier's too
        names = rng.choice((*PLAIN_PATTERNS[:2], LOOKAROUND_PATTERNS[0]))
        return {"type": "object", "propertyNames": {"pattern": names},
                "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxProperties": rng.randint(1, 3)}  # fmt: skip
    return _object(rng, depth)


def _integer(rng: Rng) -> dict[str, Any]:
    lo = rng.randint(-5, 20)
    out: dict[str, Any] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(3, 90)}
    roll = rng.random()
    if roll < 0.4:
        out["not"] = {"enum": sorted(rng.sample(range(lo, lo + 12), rng.randint(1, 4)))}
    elif roll < 0.6:
        start = lo + rng.randint(1, 5)
        out["not"] = {"minimum": start, "maximum": start + rng.randint(0, 20)}
    return out


def _string(rng: Rng) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "maxLength": rng.randint(3, 10)}
    roll = rng.random()
    if roll < 0.45:
        out["pattern"] = rng.choice(LOOKAROUND_PATTERNS)
    elif roll < 0.65:
        out["pattern"] = rng.choice(PLAIN_PATTERNS)
    if rng.random() < 0.3:
        out["not"] = {"enum": rng.sample(WORDS, 2)}
    return out


def _array(rng: Rng) -> dict[str, Any]:
    kind = rng.choice(["enum", "string", "integer"])
    if kind == "enum":
        values = rng.sample(WORDS, rng.randint(3, 6))
        items: dict[str, Any] = {"enum": values}
    elif kind == "string":
        items = {"type": "string", "maxLength": 6}
        if rng.random() < 0.5:
            items["pattern"] = rng.choice(PLAIN_PATTERNS + LOOKAROUND_PATTERNS)
    else:
        items = {"type": "integer", "minimum": 0, "maximum": 20}
    lo = rng.randint(0, 2)
    out: dict[str, Any] = {"type": "array", "items": items, "minItems": lo,
                           "maxItems": lo + rng.randint(1, 3)}  # fmt: skip
    if rng.random() < 0.6:
        out["uniqueItems"] = True
    if rng.random() < 0.25:
        if kind == "enum":
            out["contains"] = {"const": rng.choice(items["enum"])}
        else:
            out["contains"] = {"minLength": 2} if kind == "string" else {"minimum": 10}
        out["minItems"] = max(1, lo)
    return out
