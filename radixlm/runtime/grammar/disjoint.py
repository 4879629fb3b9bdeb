"""Proving that two JSON schemas accept no common instance (for ``oneOf``).

Both backends generate ``oneOf`` as ``anyOf``. The two agree exactly when no instance matches
two branches, so strict mode accepts a ``oneOf`` only when ``schemas_disjoint`` proves every
pair of its branches disjoint. The proof is sound, not complete: ``False`` means "not proven".

Rules (a schema is a conjunction of its own keywords, its ``$ref`` target and its ``allOf``
members, each a superset of it; a schema with ``anyOf`` / ``oneOf`` is a subset of their union):

- instance types that cannot overlap (``type``, and the types of ``const`` / ``enum`` values);
- a finite value set (``const`` / ``enum``) none of whose values the other schema accepts
  (checked with ``jsonschema`` itself);
- numeric ranges that do not overlap;
- objects: a property required by one side whose value schemas are disjoint (a property that
  the other side forbids, e.g. under ``additionalProperties: false``, has the ``false`` schema);
- arrays that one side requires to be non-empty, with disjoint ``items`` schemas.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from radixlm.runtime.grammar.schema_keywords import is_number, resolve_pointer

_MAX_DEPTH = 24
_ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "number"})
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")


def json_equal(x: Any, y: Any) -> bool:
    """JSON-data equality (``1 == 1.0``; ``true != 1``; objects unordered)."""
    if isinstance(x, bool) or isinstance(y, bool):
        return isinstance(x, bool) and isinstance(y, bool) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(json_equal(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(json_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def _value_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


class DisjointChecker:
    """Disjointness proofs for subschemas of one root schema (whose local ``$ref`` s resolve)."""

    def __init__(self, root: Any) -> None:
        import jsonschema

        self.root = root
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        self._validator = cls(root if isinstance(root, (dict, bool)) else {})
        # Before 2019-09, "$ref" makes a schema ignore its sibling keywords.
        self._ref_alone = cls in (
            jsonschema.Draft3Validator,
            jsonschema.Draft4Validator,
            jsonschema.Draft6Validator,
            jsonschema.Draft7Validator,
        )

    # ---- helpers -------------------------------------------------------------------------------

    def resolve(self, ref: Any) -> Any:
        return resolve_pointer(self.root, ref)

    def _facets(self, s: Any, depth: int) -> Iterator[Any]:
        """Schemas that each accept every instance ``s`` accepts: its own keywords (without
        combinators), then recursively its ``$ref`` target and ``allOf`` members."""
        if not isinstance(s, dict) or depth > _MAX_DEPTH:
            yield s
            return
        target = self.resolve(s.get("$ref")) if "$ref" in s else None
        if "$ref" in s and self._ref_alone:
            yield from self._facets(target if target is not None else True, depth + 1)
            return
        yield {k: v for k, v in s.items() if k not in _COMBINATORS}
        if target is not None:
            yield from self._facets(target, depth + 1)
        for member in s.get("allOf") or []:
            yield from self._facets(member, depth + 1)

    def _unions(self, s: Any, depth: int) -> Iterator[list[Any]]:
        """``anyOf`` / ``oneOf`` lists that ``s`` (or one of its facets' sources) must satisfy."""
        if not isinstance(s, dict) or depth > _MAX_DEPTH:
            return
        target = self.resolve(s.get("$ref")) if "$ref" in s else None
        if "$ref" in s and self._ref_alone:
            yield from self._unions(target, depth + 1)
            return
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                yield s[key]
        if target is not None:
            yield from self._unions(target, depth + 1)
        for member in s.get("allOf") or []:
            yield from self._unions(member, depth + 1)

    @staticmethod
    def _types(facet: Any) -> frozenset[str]:
        if not isinstance(facet, dict):
            return _ALL_TYPES if facet is not False else frozenset()
        out = _ALL_TYPES
        t = facet.get("type")
        if t is not None:
            names = [t] if isinstance(t, str) else t if isinstance(t, list) else []
            out = frozenset("number" if n == "integer" else n for n in names) & _ALL_TYPES
        values = DisjointChecker._values(facet)
        if values is not None:
            out &= frozenset(_value_type(v) for v in values)
        return out

    @staticmethod
    def _values(facet: Any) -> list[Any] | None:
        if not isinstance(facet, dict):
            return None
        if "const" in facet:
            return [facet["const"]]
        enum = facet.get("enum")
        return list(enum) if isinstance(enum, list) else None

    @staticmethod
    def _bounds(facet: dict[str, Any]) -> tuple[float, bool, float, bool]:
        """(low, low_exclusive, high, high_exclusive) of the numeric range a facet allows."""
        lo, lo_x, hi, hi_x = -math.inf, False, math.inf, False

        if is_number(facet.get("minimum")):
            lo = facet["minimum"]
        if is_number(facet.get("exclusiveMinimum")) and facet["exclusiveMinimum"] >= lo:
            lo, lo_x = facet["exclusiveMinimum"], True
        if is_number(facet.get("maximum")):
            hi = facet["maximum"]
        if is_number(facet.get("exclusiveMaximum")) and facet["exclusiveMaximum"] <= hi:
            hi, hi_x = facet["exclusiveMaximum"], True
        return lo, lo_x, hi, hi_x

    def _property_schemas(self, facet: dict[str, Any], name: str) -> Any:
        """The schema a facet applies to property ``name`` (``True``: not known)."""
        props = facet.get("properties")
        if isinstance(props, dict) and name in props:
            return props[name]
        if facet.get("patternProperties"):
            return True
        return facet.get("additionalProperties", True)

    def _accepts(self, schema: Any, value: Any) -> bool:
        try:
            return bool(self._validator.evolve(schema=schema).is_valid(value))
        except Exception:  # an unresolvable reference: cannot prove anything
            return True

    # ---- the proof -----------------------------------------------------------------------------

    def disjoint(self, a: Any, b: Any, depth: int = 0) -> bool:
        """True only if no JSON value is valid against both ``a`` and ``b``."""
        if a is False or b is False:
            return True
        if a is True or b is True or depth > _MAX_DEPTH:
            return False
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        for x, y in ((a, b), (b, a)):
            for union in self._unions(x, depth):
                if all(self.disjoint(m, y, depth + 1) for m in union):
                    return True
        fa, fb = list(self._facets(a, depth)), list(self._facets(b, depth))
        types_a = frozenset.intersection(*(self._types(f) for f in fa))
        types_b = frozenset.intersection(*(self._types(f) for f in fb))
        common = types_a & types_b
        if not common:
            return True
        for fx, y in ((fa, b), (fb, a)):
            for f in fx:
                values = self._values(f)
                if values is not None and not any(self._accepts(y, v) for v in values):
                    return True
        if common == {"number"} and self._ranges_disjoint(fa, fb):
            return True
        if common == {"array"} and self._arrays_disjoint(fa, fb, depth):
            return True
        return common == {"object"} and self._objects_disjoint(fa, fb, depth)

    def _ranges_disjoint(self, fa: list[Any], fb: list[Any]) -> bool:
        def bounds(fs: list[Any]) -> tuple[float, bool, float, bool]:
            lo, lo_x, hi, hi_x = -math.inf, False, math.inf, False
            for f in fs:
                if isinstance(f, dict):
                    l_, lx, h, hx = self._bounds(f)
                    if (l_, lx) > (lo, lo_x):
                        lo, lo_x = l_, lx
                    if (h, not hx) < (hi, not hi_x):
                        hi, hi_x = h, hx
            return lo, lo_x, hi, hi_x

        lo1, lx1, hi1, hx1 = bounds(fa)
        lo2, lx2, hi2, hx2 = bounds(fb)
        return (
            hi1 < lo2 or (hi1 == lo2 and (hx1 or lx2)) or hi2 < lo1 or (hi2 == lo1 and (hx2 or lx1))
        )

    def _arrays_disjoint(self, fa: list[Any], fb: list[Any], depth: int) -> bool:
        """Both non-empty arrays (a ``minItems`` >= 1 on either side: the other side must then
        hold an element too) whose ``items`` schemas are disjoint: no first element fits both."""
        facets = [f for f in fa + fb if isinstance(f, dict)]
        if any("prefixItems" in f or isinstance(f.get("items"), list) for f in facets):
            return False
        if not any(is_number(f.get("minItems")) and f["minItems"] >= 1 for f in facets):
            return False
        ia = [f["items"] for f in fa if isinstance(f, dict) and "items" in f]
        ib = [f["items"] for f in fb if isinstance(f, dict) and "items" in f]
        return any(self.disjoint(x, y, depth + 1) for x in ia for y in ib)

    def _objects_disjoint(self, fa: list[Any], fb: list[Any], depth: int) -> bool:
        def required(fs: list[Any]) -> set[str]:
            out: set[str] = set()
            for f in fs:
                if isinstance(f, dict) and isinstance(f.get("required"), list):
                    out.update(n for n in f["required"] if isinstance(n, str))
            return out

        for name in sorted(required(fa) | required(fb)):
            sa = [self._property_schemas(f, name) for f in fa if isinstance(f, dict)]
            sb = [self._property_schemas(f, name) for f in fb if isinstance(f, dict)]
            if any(self.disjoint(x, y, depth + 1) for x in sa for y in sb):
                return True
        return False


def one_of_disjoint(root: Any, schema: dict[str, Any]) -> bool:
    """True if the ``oneOf`` branches of ``schema`` (a subschema of ``root``), each taken
    together with ``schema``'s other keywords, are pairwise disjoint."""
    branches = schema.get("oneOf")
    if not isinstance(branches, list):
        return True
    siblings = {k: v for k, v in schema.items() if k != "oneOf"}
    checker = DisjointChecker(root)
    full = [{"allOf": [b, siblings]} for b in branches]
    return all(
        checker.disjoint(full[i], full[j])
        for i in range(len(full))
        for j in range(i + 1, len(full))
    )
