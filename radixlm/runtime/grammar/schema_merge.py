"""The intersection of two JSON-schema objects as one schema object, where that is exact.

``merge_schemas(a, b, conj)`` returns a schema whose valid instances are exactly those valid
against both ``a`` and ``b``; ``False`` when it proves no instance can be (disjoint types);
None when one object cannot say it exactly (then the caller keeps an ``allOf``). Subschemas
that both sides apply to one location (a property, the items) are combined by ``conj``, the
caller's own conjunction, so that they are normalized too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.runtime.grammar.disjoint import json_equal
from radixlm.runtime.grammar.schema_facts import intersect_types, type_spec
from radixlm.runtime.grammar.schema_keywords import NON_ASSERTING, is_number

Conj = Callable[[list[Any]], Any]  # schemas -> one schema accepting what every one accepts

_MIN = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"})
_MAX = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"})
# Keyword groups whose meaning depends on each other: only one merge side may use them.
_ONE_SIDE = (
    frozenset({"contains", "minContains", "maxContains"}),
    frozenset({"if", "then", "else"}),
    frozenset({"not"}),
    frozenset({"anyOf"}),
    frozenset({"oneOf"}),
    frozenset({"dependentSchemas"}),
    frozenset({"dependencies"}),
    frozenset({"propertyNames"}),
)
_NO_MERGE = frozenset(
    {"$ref", "$dynamicRef", "$recursiveRef", "$id", "$anchor", "$dynamicAnchor", "$defs",
     "definitions", "unevaluatedProperties", "unevaluatedItems", "$schema"}
)  # fmt: skip
_OBJECT_KEYS = frozenset({"properties", "additionalProperties", "patternProperties"})
_ARRAY_KEYS = frozenset({"items", "prefixItems"})


def merge_schemas(a: dict[str, Any], b: dict[str, Any], conj: Conj) -> Any:
    """``a`` and ``b`` as one schema object, ``False`` when no instance can satisfy both,
    or None if that cannot be exact."""
    if all(k in a and json_equal(a[k], v) for k, v in b.items()):
        return dict(a)  # b restates keywords of a: implied
    if any(k in b for k in _NO_MERGE) or any(
        k in a for k in _NO_MERGE - {"$defs", "definitions", "$schema", "$id"}
    ):
        return None
    for group in _ONE_SIDE:
        if group & a.keys() and group & b.keys():
            return None
    out = dict(a)
    if _OBJECT_KEYS & a.keys() and _OBJECT_KEYS & b.keys():
        objects = _merge_objects(a, b, conj)
        if objects is None:
            return None
        out.update(objects)
    else:
        out.update({k: b[k] for k in _OBJECT_KEYS & b.keys()})
    if _ARRAY_KEYS & a.keys() and _ARRAY_KEYS & b.keys():
        if "prefixItems" in a or "prefixItems" in b:
            if any(not json_equal(a.get(k), b.get(k)) for k in _ARRAY_KEYS):
                return None
        elif isinstance(a["items"], list) or isinstance(b["items"], list):
            return None
        else:
            out["items"] = conj([a["items"], b["items"]])
    else:
        out.update({k: b[k] for k in _ARRAY_KEYS & b.keys()})
    for key, value in b.items():
        if key in _OBJECT_KEYS or key in _ARRAY_KEYS:
            continue
        if key not in a or key in NON_ASSERTING:
            out.setdefault(key, value)
            continue
        merged = _merge_keyword(key, a[key], value)
        if merged is None or merged is False:
            return merged
        out[key] = merged[0]
    return out


def _merge_keyword(key: str, mine: Any, value: Any) -> tuple[Any] | bool | None:
    """One keyword present on both sides -> ``(merged value,)``; ``False``: no instance
    satisfies both; None: not expressible as one value."""
    if key == "type":
        types = intersect_types(mine, value)
        if not types:  # no instance has both types (when both are well formed)
            return False if type_spec(mine) and type_spec(value) else None
        return (types[0] if len(types) == 1 else types,)
    if key in _MIN and is_number(mine) and is_number(value):
        return (max(mine, value),)
    if key in _MAX and is_number(mine) and is_number(value):
        return (min(mine, value),)
    if key == "required" and isinstance(mine, list) and isinstance(value, list):
        return (list(dict.fromkeys([*mine, *value])),)
    if key == "enum" and isinstance(mine, list) and isinstance(value, list):
        both = [x for x in mine if any(json_equal(x, y) for y in value)]
        return (both,) if both else None
    if key == "uniqueItems":
        return (bool(mine) or bool(value),)
    if key == "dependentRequired" and isinstance(mine, dict) and isinstance(value, dict):
        return ({
            k: list(dict.fromkeys([*mine.get(k, []), *value.get(k, [])]))
            for k in dict.fromkeys([*mine, *value])
        },)  # fmt: skip
    return (mine,) if json_equal(mine, value) else None


def _merge_objects(a: dict[str, Any], b: dict[str, Any], conj: Conj) -> dict[str, Any] | None:
    """Per property: the conjunction of what each side applies to it (its ``properties``
    entry, else its ``additionalProperties``)."""
    if "patternProperties" in a or "patternProperties" in b:
        return None
    pa, pb = a.get("properties", {}), b.get("properties", {})
    if not isinstance(pa, dict) or not isinstance(pb, dict):
        return None

    def applied(side: dict[str, Any], props: dict[str, Any], name: str) -> Any:
        if name in props:
            return props[name]
        return side.get("additionalProperties", True)

    props = {
        name: conj([applied(a, pa, name), applied(b, pb, name)])
        for name in dict.fromkeys([*pa, *pb])
    }
    out: dict[str, Any] = {"properties": props}
    extra = [s["additionalProperties"] for s in (a, b) if "additionalProperties" in s]
    if extra:
        out["additionalProperties"] = conj(extra)
    return out
