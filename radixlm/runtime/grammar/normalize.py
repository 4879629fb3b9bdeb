"""Exact JSON-schema rewrites before compilation: more schemas become enforceable.

``normalize_schema`` returns a schema with the same set of valid instances (under the
schema's own draft, as ``jsonschema`` validates it), built from keywords the backends enforce.
A rewrite that cannot be made exactly is not made: the keyword stays, and strict mode then
refuses it by name. Rewrites, bottom-up:

- ``$ref`` with sibling keywords: siblings dropped before 2019-09 (the validator ignores them),
  else the target inlined and merged with them.
- ``allOf``: members merged into their parent where the intersection is one schema (types
  intersected, ``properties`` / ``required`` / ``additionalProperties`` combined per property,
  numeric and length bounds tightened, ``enum`` intersected, ...); unmergeable members stay.
- draft-04 boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` -> the numeric form.
- ``items`` as an array (drafts before 2020-12) -> ``prefixItems``, with ``additionalItems`` ->
  ``items``; ``additionalItems`` where the validator ignores it is dropped.
- ``dependentRequired`` / ``dependentSchemas`` / ``dependencies`` (up to 3 triggers) ->
  ``anyOf`` of the cases (trigger absent: its property schema ``false``; present: required,
  with the dependent schema merged).
- ``if`` / ``then`` / ``else`` on an object whose discriminating property is required and has a
  finite value set (``const`` / ``enum``), or an ``if`` that only requires one property ->
  a disjoint ``anyOf`` of (values where ``if`` holds, merged with ``then``) and (the other
  values, merged with ``else``).
- ``uniqueItems`` on arrays whose items come from a finite set (``enum`` / ``const`` /
  boolean) of at most 4 values -> an ``enum`` of every array the original schema accepts
  (each checked with ``jsonschema``).
- ``not`` of ``{}``, ``required``, ``type``, a one-class ``pattern`` and ``anyOf`` / ``allOf``
  of those -> the cases of its negation (``schema_facts.negation``: ``false``; "one listed
  property absent"; the other types; a string of the complement pattern), merged into the
  schema as an ``anyOf`` (anyOf needs no disjointness).
- ``oneOf`` not proven disjoint whose branches all have such a negation -> the ``anyOf`` of
  "this branch and none of the others" for each branch.
- a declared property under ``patternProperties`` that also match its name: its schema ->
  ``{}`` where it equals theirs; or, where it is a proven subset (``subsume``) of patterns that
  match every name, those patterns -> "every name but this one" (``patterns.names_except``).
- ``format`` values that no draft defines (``"url"``, ``"semver"``, ...) are annotations for
  every validator: dropped.
- ``format`` with an exact (or over-strict) regex in ``formats.FORMAT_PATTERNS`` (date, time,
  date-time, uuid, ipv4, ipv6, hostname, uri) and no sibling ``pattern`` -> that ``pattern``.
- ``required`` names that ``properties`` does not declare are declared, with the
  ``additionalProperties`` schema (or any value), when no ``patternProperties`` is present.

One rewrite is over-strict instead of exact (never invalid, fewer instances): a ``oneOf``
left after the above, its branches narrowed until provably disjoint (``_one_of_made_disjoint``).

``lower_for_backends`` then removes ``false`` property schemas where the backends' "only
declared properties" behaviour already excludes the property (they cannot compile ``false``).

Schemas with ``$id`` / ``$anchor`` below the root, or a ``$ref`` into anything but
``$defs`` / ``definitions`` / the root, are left as they are (moving subschemas would change
what those references point to).
"""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

from radixlm.runtime.grammar.disjoint import DisjointChecker, json_equal, one_of_disjoint
from radixlm.runtime.grammar.formats import FORMAT_PATTERNS
from radixlm.runtime.grammar.patterns import (
    matches_every_name,
    names_except,
    regex_matches,
)
from radixlm.runtime.grammar.schema_facts import (
    MAX_NOT_CASES,
    finite_values,
    intersect_types,
    negation,
    required_and_forbidden,
    type_spec,
)
from radixlm.runtime.grammar.schema_keywords import (
    ANNOTATIONS,
    NON_ASSERTING,
    SPEC_FORMATS,
    VALIDATION_KEYWORDS,
    is_number,
    map_subschemas,
    resolve_pointer,
    strip_annotations,
)
from radixlm.runtime.grammar.subsume import SubsetChecker

_MAX_DEPTH = 64
_MAX_DEPENDENCIES = 3
_MAX_UNIQUE_VALUES = 4
_MAX_UNIQUE_ARRAYS = 128
_MAX_DISTRIBUTED_BYTES = 256 * 1024
_MAX_ONE_OF = 4
_MAX_NARROWED_ONE_OF = 16
_MAX_NARROWINGS = 12
# Keys that stay at a rewritten node instead of being copied into its anyOf branches.
_HOST = ("$schema", "$id", "$defs", "definitions", "$comment", "title", "description",
         "default", "examples")  # fmt: skip
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


class _Draft:
    def __init__(self, root: Any) -> None:
        import jsonschema

        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
        self.keywords = frozenset(cls.VALIDATORS)
        self.cls = cls
        self.root = root
        self.validator = cls(root)
        self.ref_alone = "prefixItems" not in self.keywords  # before 2019-09: $ref hides siblings


def _movable(root: Any) -> bool:
    """No reference that rewrites could redirect (see the module docstring)."""
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_DEPTH:
            return False
        if isinstance(node, dict):
            if depth and any(k in node for k in ("$id", "$anchor", "$dynamicAnchor")):
                return False
            for key in ("$ref", "$dynamicRef", "$recursiveRef"):
                ref = node.get(key)
                if isinstance(ref, str) and ref.startswith("#") and ref != "#":
                    head = ref[2:].split("/")[0] if ref.startswith("#/") else ""
                    if head not in ("$defs", "definitions"):
                        return False
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return True


def normalize_schema(schema: Any) -> Any:
    """An equivalent schema with more keywords in enforceable form (see the module docstring)."""
    if not isinstance(schema, dict):
        return schema
    body = _drop_inner_dialects(copy.deepcopy(schema), 0)
    return _Normalizer(_Draft(body), _movable(schema)).node(copy.deepcopy(body), 0)


def _drop_inner_dialects(s: Any, depth: int) -> Any:
    """``$schema`` below the root of a schema without embedded resources (no ``$id`` there) is
    ignored by validators: dropped, so that such subschemas merge."""
    if not isinstance(s, dict) or depth > _MAX_DEPTH:
        return s
    out = map_subschemas(s, lambda v: _drop_inner_dialects(v, depth + 1))
    if depth and "$schema" in out and "$id" not in out and "id" not in out:
        del out["$schema"]
    return out


class _Normalizer:
    def __init__(self, draft: _Draft, movable: bool) -> None:
        self.draft = draft
        self.movable = movable  # False: only rewrites that move no subschema
        self._inlining: list[str] = []  # references being inlined (cycle guard)
        self._size = 0  # bytes of schema text created by distributing siblings
        self._subsets: SubsetChecker | None = None
        self._disjoint: DisjointChecker | None = None
        self._inlined: dict[str, Any] = {}  # reference -> its normalized target

    @property
    def disjoint(self) -> DisjointChecker:
        if self._disjoint is None:
            self._disjoint = DisjointChecker(self.draft.root)
        return self._disjoint

    @property
    def subsets(self) -> SubsetChecker:
        if self._subsets is None:
            self._subsets = SubsetChecker(self.draft.root)
        return self._subsets

    def inline(self, s: Any, depth: int) -> Any:
        """A schema that is only a local ``$ref`` (plus annotations), replaced by its normalized
        target; anything else as it is."""
        if not isinstance(s, dict) or not isinstance(s.get("$ref"), str):
            return s
        if any(k not in NON_ASSERTING and k != "$ref" for k in s):
            return s
        ref = s["$ref"]
        if ref in self._inlining or depth > _MAX_DEPTH or not ref.startswith("#/"):
            return s
        if ref in self._inlined:  # a partly inlined result is as exact as a full one
            return copy.deepcopy(self._inlined[ref])
        target = resolve_pointer(self.draft.root, ref)
        if target is None:
            return s
        self._inlining.append(ref)
        try:
            out = self.node(copy.deepcopy(target), depth + 1)
        finally:
            self._inlining.pop()
        self._inlined[ref] = out
        return copy.deepcopy(out)

    # ---- traversal -----------------------------------------------------------------------------

    def node(self, s: Any, depth: int) -> Any:
        if not isinstance(s, dict) or depth > _MAX_DEPTH:
            return s
        s = self._children(s, depth)
        if "$ref" in s and self.movable:
            s = self._ref_siblings(s, depth)
            if not isinstance(s, dict) or "$ref" in s:
                return s
        local = (self._no_ops, self._formats, self._boolean_bounds, self._declare_required,
                 self._pattern_overlaps, self._finite)  # fmt: skip
        steps = (
            self._no_ops, self._formats, self._boolean_bounds, self._items_array, self._all_of,
            self._declare_required, self._pattern_overlaps, self._unique_items,
            self._if_then_else, self._dependencies, self._not, self._one_of,
            self._one_of_made_disjoint, self._implied_type,
            self._distribute, self._finite,
        ) if self.movable else local  # fmt: skip
        for step in steps:
            if not isinstance(s, dict):
                break
            s = step(s, depth)
        return s

    def _children(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        return map_subschemas(s, lambda v: self.node(v, depth + 1))

    # ---- conjunction ---------------------------------------------------------------------------

    def conj(self, parts: list[Any], depth: int) -> Any:
        """One schema accepting exactly what every part accepts (an ``allOf`` where a merge
        is not exact)."""
        kept = [p for p in parts if p is not True and p != {}]
        if any(p is False for p in kept):
            return False
        if not kept:
            return {}
        if len(kept) == 1:
            return kept[0]
        return self.node({"allOf": kept}, depth + 1)

    def _all_of(self, s: dict[str, Any], depth: int) -> Any:
        members = s.get("allOf")
        if not isinstance(members, list) or "allOf" not in self.draft.keywords:
            return s
        merged: Any = {k: v for k, v in s.items() if k != "allOf"}
        rest = []
        for m in members:
            if m is True or m == {}:
                continue
            if m is False:
                return False
            m = self.inline(m, depth)
            result = self.merge(merged, m, depth) if isinstance(m, dict) else None
            if result is False:
                return False
            if result is None:
                rest.append(m)
            else:
                merged = result
                rest.extend(merged.pop("allOf", []))  # a member's own unmerged members
        if merged is False:
            return False
        if rest:
            merged["allOf"] = rest
        return merged

    def merge(self, a: dict[str, Any], b: dict[str, Any], depth: int) -> Any:
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
        obj_keys = {"properties", "additionalProperties", "patternProperties"}
        if obj_keys & a.keys() and obj_keys & b.keys():
            objects = self._merge_objects(a, b, depth)
            if objects is None:
                return None
            out.update(objects)
        else:
            out.update({k: b[k] for k in obj_keys & b.keys()})
        arr_keys = {"items", "prefixItems"}
        if arr_keys & a.keys() and arr_keys & b.keys():
            if "prefixItems" in a or "prefixItems" in b:
                if any(not json_equal(a.get(k), b.get(k)) for k in arr_keys):
                    return None
            elif isinstance(a["items"], list) or isinstance(b["items"], list):
                return None
            else:
                out["items"] = self.conj([a["items"], b["items"]], depth)
        else:
            out.update({k: b[k] for k in arr_keys & b.keys()})
        for key, value in b.items():
            if key in obj_keys or key in arr_keys:
                continue
            if key not in a or key in NON_ASSERTING:
                out.setdefault(key, value)
                continue
            mine = a[key]
            if key == "type":
                types = intersect_types(mine, value)
                if not types:  # no instance has both types (when both are well formed)
                    return False if type_spec(mine) and type_spec(value) else None
                out["type"] = types[0] if len(types) == 1 else types
            elif key in _MIN and is_number(mine) and is_number(value):
                out[key] = max(mine, value)
            elif key in _MAX and is_number(mine) and is_number(value):
                out[key] = min(mine, value)
            elif key == "required" and isinstance(mine, list) and isinstance(value, list):
                out[key] = list(dict.fromkeys([*mine, *value]))
            elif key == "enum" and isinstance(mine, list) and isinstance(value, list):
                both = [x for x in mine if any(json_equal(x, y) for y in value)]
                if not both:
                    return None
                out[key] = both
            elif key == "uniqueItems":
                out[key] = bool(mine) or bool(value)
            elif key == "dependentRequired" and isinstance(mine, dict) and isinstance(value, dict):
                out[key] = {
                    k: list(dict.fromkeys([*mine.get(k, []), *value.get(k, [])]))
                    for k in dict.fromkeys([*mine, *value])
                }
            elif not json_equal(mine, value):
                return None
        return out

    def _merge_objects(
        self, a: dict[str, Any], b: dict[str, Any], depth: int
    ) -> dict[str, Any] | None:
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
            name: self.conj([applied(a, pa, name), applied(b, pb, name)], depth)
            for name in dict.fromkeys([*pa, *pb])
        }
        out: dict[str, Any] = {"properties": props}
        extra = [s["additionalProperties"] for s in (a, b) if "additionalProperties" in s]
        if extra:
            out["additionalProperties"] = self.conj(extra, depth)
        return out

    # ---- rewrites ------------------------------------------------------------------------------

    def _items_array(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        if "prefixItems" in self.draft.keywords:
            if "additionalItems" in s:  # not a keyword of this draft: the validator ignores it
                s = {k: v for k, v in s.items() if k != "additionalItems"}
            return s
        items = s.get("items")
        if not isinstance(items, list):
            return {k: v for k, v in s.items() if k != "additionalItems"}
        out = {k: v for k, v in s.items() if k not in ("items", "additionalItems")}
        out["prefixItems"] = items
        if "additionalItems" in s and s["additionalItems"] is not True:
            out["items"] = s["additionalItems"]
        return out

    def _declare_required(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        required = s.get("required")
        props = s.get("properties", {})
        if not isinstance(required, list) or not isinstance(props, dict):
            return s
        missing = [n for n in required if isinstance(n, str) and n not in props]
        extra = s.get("additionalProperties", True)
        if not missing or "patternProperties" in s or extra is False:
            return s
        return {**s, "properties": {**props, **{n: extra if extra is not True else {}
                                                for n in missing}}}  # fmt: skip

    def _pattern_overlaps(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        """A declared property's value must satisfy its own schema and that of every
        ``patternProperties`` pattern matching its name. The backends intersect the two, and
        llguidance cannot when both hold recursive ``$ref`` s; so where the conjunction is one
        of the two already:

        - the property's schema equals (annotations aside) every matching pattern's, or they
          are ``{}``: the property's schema -> ``{}`` (the patterns say it all);
        - every matching pattern matches every name and its schema is proven a superset
          (``subsume``) of the property's: those patterns -> ``names_except`` of such
          properties (the property's schema says it all).

        Matches are decided by ``patterns.regex_matches``; an undecided one keeps the schema."""
        props, patterns = s.get("properties"), s.get("patternProperties")
        if not isinstance(props, dict) or not isinstance(patterns, dict) or not patterns:
            return s
        bare = {p: strip_annotations(v) for p, v in patterns.items()}
        out = dict(props)
        excluded: dict[str, list[str]] = {}
        for name, schema in props.items():
            verdicts = {p: regex_matches(p, name) for p in patterns}
            matching = [p for p, hit in verdicts.items() if hit]
            if not matching or None in verdicts.values():
                continue
            own = strip_annotations(schema)
            same = [json_equal(own, bare[p]) for p in matching]
            if any(same) and all(eq or bare[p] in (True, {}) for p, eq in zip(matching, same)):
                out[name] = {}
            elif self.movable and all(
                matches_every_name(p) and self.subsets.subset(schema, patterns[p]) for p in matching
            ):
                for p in matching:
                    excluded.setdefault(p, []).append(name)
        renamed = {p: names_except(names) for p, names in excluded.items()}
        if any(r in patterns for r in renamed.values()):
            renamed = {}
        if out == props and not renamed:
            return s
        return {
            **s,
            "properties": out,
            "patternProperties": {renamed.get(p, p): v for p, v in patterns.items()},
        }

    def _unique_items(self, s: dict[str, Any], depth: int) -> Any:
        if s.get("uniqueItems") is not True or s.get("type") != "array":
            return s
        if any(k not in ("type", "items", "minItems", "maxItems", "uniqueItems")
               and k not in NON_ASSERTING for k in s):  # fmt: skip
            return s
        values = finite_values(s.get("items"))
        if values is None or len(values) > _MAX_UNIQUE_VALUES:
            return s
        validator = self.draft.cls(s)
        arrays = [
            list(p)
            for n in range(len(values) + 1)
            for p in itertools.permutations(values, n)
            if validator.is_valid(list(p))
        ]
        if len(arrays) > _MAX_UNIQUE_ARRAYS:
            return s
        if not arrays:
            return False
        return {**{k: v for k, v in s.items() if k in NON_ASSERTING}, "enum": arrays}

    def _branches(self, s: dict[str, Any], cases: list[list[Any]], depth: int) -> Any:
        """``s`` (without the rewritten keywords) as an ``anyOf`` of ``s`` merged with each case's
        schemas; None if a merge is not exact."""
        host = {k: v for k, v in s.items() if k in _HOST}
        body = {k: v for k, v in s.items() if k not in _HOST}
        branches = []
        for case in cases:
            b = self.conj([body, *case], depth)
            if isinstance(b, dict) and "allOf" in b:
                return None
            if b is not False and not required_and_forbidden(b):
                branches.append(b)
        if not branches:
            return False
        if len(branches) == 1:
            return {**host, **branches[0]} if isinstance(branches[0], dict) else branches[0]
        return {**host, "anyOf": branches}

    def _if_then_else(self, s: dict[str, Any], depth: int) -> Any:
        if "if" not in s or "if" not in self.draft.keywords:
            return s
        cond, then, other = s["if"], s.get("then", True), s.get("else", True)
        body = {k: v for k, v in s.items() if k not in ("if", "then", "else")}
        if then is True and other is True:
            return body
        if cond is True or cond is False:
            return self.conj([body, then if cond else other], depth)
        if not isinstance(cond, dict) or s.get("type") != "object":
            return s
        keys = {k for k in cond if k not in NON_ASSERTING}
        cprops = cond.get("properties", {})
        if not isinstance(cprops, dict):
            return s
        cprops = {k: v for k, v in cprops.items() if v is not True and v != {}}
        if not cprops:
            keys.discard("properties")
        required = body.get("required", [])
        props = body.get("properties", {})
        creq = cond.get("required")
        if keys == {"required"} and isinstance(creq, list) and len(creq) == 1:
            name = creq[0]
            cases = [[{"required": [name]}, then], [{"properties": {name: False}}, other]]
        elif keys <= {"properties", "required", "type"} and cond.get("type", "object") == "object":
            if len(cprops) != 1:
                return s
            ((name, cschema),) = cprops.items()
            if creq not in (None, [name]) or name not in required:
                return s
            wanted = finite_values(cschema)
            known = finite_values(props.get(name)) if isinstance(props, dict) else None
            if wanted is None or known is None:
                return s
            yes = [v for v in known if any(json_equal(v, w) for w in wanted)]
            no = [v for v in known if not any(json_equal(v, w) for w in wanted)]
            cases = [
                [{"properties": {name: {"enum": vals}}}, branch]
                for vals, branch in ((yes, then), (no, other))
                if vals
            ]
        else:
            return s
        out = self._branches(body, cases, depth)
        return s if out is None else out

    @staticmethod
    def _no_ops(s: dict[str, Any], depth: int) -> dict[str, Any]:
        """Drop keywords that assert nothing: a ``format`` that no JSON Schema draft defines
        (validators treat it as an annotation; defined formats stay and must be enforced
        exactly) and ``uniqueItems: false``."""
        fmt = s.get("format")
        drop = {"format"} if isinstance(fmt, str) and fmt not in SPEC_FORMATS else set()
        if s.get("uniqueItems") is False:
            drop.add("uniqueItems")
        return {k: v for k, v in s.items() if k not in drop} if drop else s

    @staticmethod
    def _formats(s: dict[str, Any], depth: int) -> dict[str, Any]:
        """``format: F`` -> ``pattern: FORMAT_PATTERNS[F]`` (same valid strings, or fewer where
        formats.py says "subset"; both apply to strings only), unless a ``pattern`` is already
        there (the format then stays for the backend, or strict mode)."""
        fmt = s.get("format")
        if not isinstance(fmt, str) or fmt not in FORMAT_PATTERNS or "pattern" in s:
            return s
        return {("pattern" if k == "format" else k): (FORMAT_PATTERNS[fmt] if k == "format" else v)
                for k, v in s.items()}  # fmt: skip

    @staticmethod
    def _boolean_bounds(s: dict[str, Any], depth: int) -> dict[str, Any]:
        """Draft-04 ``exclusiveMinimum: true`` (a flag on ``minimum``) -> the numeric form."""
        out = s
        for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(out.get(flag), bool):
                out = dict(out)
                if out.pop(flag) and is_number(out.get(bound)):
                    out[flag] = out.pop(bound)
        return out

    def _ref_siblings(self, s: dict[str, Any], depth: int) -> Any:
        """``$ref`` with sibling keywords: before 2019-09 the siblings do not apply (dropped);
        later they do (the target inlined and merged with them, when that is exact)."""
        siblings = [k for k in s if k in VALIDATION_KEYWORDS and k != "$ref"]
        if not siblings:
            return s
        if self.draft.ref_alone:
            return {k: v for k, v in s.items() if k not in VALIDATION_KEYWORDS or k == "$ref"}
        target = self.inline({"$ref": s["$ref"]}, depth)
        if not isinstance(target, dict) or "$ref" in target:
            return s
        host = {k: v for k, v in s.items() if k in _HOST}
        rest = {k: v for k, v in s.items() if k != "$ref" and k not in _HOST}
        merged = self.conj([target, rest], depth)
        if not isinstance(merged, dict) or "allOf" in merged:
            return s if merged is not False else False
        return {**host, **merged}

    def _distribute(self, s: dict[str, Any], depth: int) -> Any:
        """``{S, anyOf/oneOf: [B...]}`` -> ``{anyOf/oneOf: [S and B, ...]}`` (exact; the backends
        ignore keywords beside a combinator)."""
        keys = [k for k in ("anyOf", "oneOf") if isinstance(s.get(k), list)]
        siblings = {k: v for k, v in s.items() if k not in _HOST and k not in keys}
        if len(keys) != 1 or not siblings or "allOf" in s or "$ref" in s:
            return s
        if not any(k in VALIDATION_KEYWORDS for k in siblings):
            return s
        key = keys[0]
        size = len(json.dumps(siblings)) * len(s[key])
        if self._size + size > _MAX_DISTRIBUTED_BYTES:
            return s
        branches = []
        for b in s[key]:
            merged = self.conj([siblings, self.inline(b, depth)], depth)
            if isinstance(merged, dict) and "allOf" in merged:
                return s
            branches.append(merged)
        self._size += size
        branches = [b for b in branches if b is not False]  # never matches: no effect
        if not branches:
            return False
        host = {k: v for k, v in s.items() if k in _HOST}
        return {**host, key: branches}

    def _finite(self, s: dict[str, Any], depth: int) -> Any:
        """``const`` / ``enum`` with other validation keywords -> the ``enum`` of the values
        that the whole schema accepts (the backends ignore keywords beside them)."""
        values = s["enum"] if isinstance(s.get("enum"), list) else None
        if "const" in s:
            values = [s["const"]]
        others = [k for k in s if k in VALIDATION_KEYWORDS and k not in ("enum", "const")]
        if values is None or not others:
            return s
        try:
            check = self.draft.validator.evolve(schema=s)
            kept = [v for v in values if check.is_valid(v)]
        except Exception:  # an unresolvable reference: leave it to strict mode
            return s
        kept = [v for i, v in enumerate(kept) if not any(json_equal(v, w) for w in kept[:i])]
        if not kept:
            return False
        rest = {k: v for k, v in s.items() if k not in VALIDATION_KEYWORDS and k != "const"}
        return {**rest, "enum": kept}

    def _implied_type(self, s: dict[str, Any], depth: int) -> Any:
        """A ``type`` beside an ``anyOf`` / ``oneOf`` whose every branch (a ``$ref`` followed)
        already states a type within it is dropped (exact; llguidance cannot intersect a
        sibling with a recursive reference)."""
        types = s.get("type")
        wanted = set(types) if isinstance(types, list) else {types}
        if "number" in wanted:
            wanted.add("integer")
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if not isinstance(branches, list) or not branches:
                continue
            for b in branches:
                if isinstance(b, dict) and isinstance(b.get("$ref"), str):
                    b = resolve_pointer(self.draft.root, b["$ref"])
                t = b.get("type") if isinstance(b, dict) else None
                stated = set(t) if isinstance(t, list) else {t}
                if t is None or not stated <= wanted:
                    break
            else:
                return {k: v for k, v in s.items() if k != "type"}
        return s

    def _not(self, s: dict[str, Any], depth: int) -> Any:
        """``not`` rewritten as the cases of its negation (``negation``) merged with the
        rest of ``s``; kept when a case has no exact form or does not merge."""
        if "not" not in s or "not" not in self.draft.keywords:
            return s
        cases = negation(self.inline(s["not"], depth))
        if cases is None:
            return s
        out = self._branches({k: v for k, v in s.items() if k != "not"}, cases, depth)
        return s if out is None else out

    def _one_of(self, s: dict[str, Any], depth: int) -> Any:
        """``oneOf`` whose branches are not proven disjoint, each with an exact negation
        (``negation``) -> the ``anyOf`` of each branch and not the others, merged with the rest
        of ``s`` (exactly one branch holds; the cases are disjoint by construction). Kept when
        a negation or a merge is not exact, or the cases are too many."""
        branches = s.get("oneOf")
        if not isinstance(branches, list) or not 2 <= len(branches) <= _MAX_ONE_OF:
            return s
        if "oneOf" not in self.draft.keywords or one_of_disjoint(self.draft.root, s):
            return s  # disjoint: the backends' anyOf reading is exact already
        inlined = [self.inline(b, depth) for b in branches]
        negations = [negation(b) for b in inlined]
        cases: list[list[Any]] = []
        for i, branch in enumerate(inlined):
            combos: list[list[Any]] = [[branch]]
            for j, cases_j in enumerate(negations):
                if j == i:
                    continue
                if cases_j is None:
                    return s
                combos = [c + case for c in combos for case in cases_j]
                if len(combos) > MAX_NOT_CASES:
                    return s
            cases += combos
        out = self._branches({k: v for k, v in s.items() if k != "oneOf"}, cases, depth)
        return s if out is None else out

    def _one_of_made_disjoint(self, s: dict[str, Any], depth: int) -> Any:
        """Over-strict, never invalid: a ``oneOf`` still there (not proven disjoint, no exact
        rewrite) -> an ``anyOf`` of its branches, each narrowed (``_narrowings``) until it is
        proven disjoint from every other, unnarrowed branch. An instance of a narrowed branch
        then matches that branch and no other: exactly one, as ``oneOf`` asks. Instances
        that only the narrowing leaves out (an object without its discriminator, an empty
        array) are no longer generated. A branch that cannot be narrowed so is dropped when it
        is a proven subset of another (each of its instances matches two branches: none is
        valid); else the ``oneOf`` stays."""
        branches = s.get("oneOf")
        if not isinstance(branches, list) or not 2 <= len(branches) <= _MAX_NARROWED_ONE_OF:
            return s
        if "oneOf" not in self.draft.keywords or "anyOf" in s:
            return s
        siblings = {k: v for k, v in s.items() if k != "oneOf" and k not in _HOST}
        full = [{"allOf": [b, siblings]} for b in branches]
        narrowed = []
        for i, branch in enumerate(branches):
            target = self.inline(branch, depth)
            for extra in self._narrowings(target):
                mine = {"allOf": [branch, extra, siblings]}
                if all(self.disjoint.disjoint(mine, f) for j, f in enumerate(full) if j != i):
                    narrowed.append(self.conj([target, extra], depth) if extra else branch)
                    break
            else:  # exact to drop only if every instance of it matches another branch too
                if not any(self.subsets.subset(branch, b) for b in branches if b is not branch):
                    return s
        if not narrowed:
            return s
        host = {k: v for k, v in s.items() if k != "oneOf"}
        return {**host, "anyOf": narrowed}

    @staticmethod
    def _narrowings(branch: Any) -> list[dict[str, Any]]:
        """Schemas to intersect a ``oneOf`` branch with, weakest first: nothing; for an object,
        "is an object holding property k" for each declared k (those with a finite value set,
        likely a discriminator, first); for an array, "not empty"."""
        out: list[dict[str, Any]] = [{}]
        if not isinstance(branch, dict):
            return out
        props = branch.get("properties")
        if isinstance(props, dict) and branch.get("type", "object") == "object":
            required = branch.get("required") if isinstance(branch.get("required"), list) else []
            names = [n for n in props if n not in required and props[n] is not False]
            names.sort(key=lambda n: finite_values(props[n]) is None)
            out += [{"type": "object", "required": [n]} for n in names[:_MAX_NARROWINGS]]
        if branch.get("type") == "array" and not branch.get("minItems"):
            out.append({"minItems": 1})
        return out

    def _dependencies(self, s: dict[str, Any], depth: int) -> Any:
        deps: list[tuple[str, Any]] = []  # (trigger, dependent schema)
        rest = dict(s)
        for key in ("dependentRequired", "dependentSchemas", "dependencies"):
            value = s.get(key)
            if key not in self.draft.keywords or not isinstance(value, dict):
                continue
            for name, dep in value.items():
                deps.append((name, {"required": dep} if isinstance(dep, list) else dep))
            del rest[key]
        if not deps:
            return s
        required = rest.get("required", []) if isinstance(rest.get("required"), list) else []
        always = [(n, d) for n, d in deps if n in required]
        optional = [(n, d) for n, d in deps if n not in required]
        if len(optional) > _MAX_DEPENDENCIES:
            return s
        cases = []
        for present in itertools.product((True, False), repeat=len(optional)):
            case = [d for _, d in always]
            for (name, dep), here in zip(optional, present, strict=True):
                case += [{"required": [name]}, dep] if here else [{"properties": {name: False}}]
            cases.append(case)
        out = self._branches(rest, cases, depth)
        return s if out is None else out


def lower_for_backends(schema: Any, depth: int = 0) -> Any:
    """Make "declared properties only" explicit, then use it. Every backend generates only
    declared properties (over-strict, like OpenAI's strict mode): a schema with ``properties``
    and no ``additionalProperties`` / ``unevaluatedProperties`` gets ``additionalProperties:
    false`` (xgrammar and outlines behave so anyway; llguidance would otherwise generate extra
    keys). Then ``properties`` entries that are ``false`` are dropped where the property cannot
    be generated anyway (the backends cannot compile ``false``). A ``false`` entry that is also
    required makes the object unsatisfiable: it is kept (the backend then refuses the
    schema)."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return schema
    out = map_subschemas(schema, lambda v: lower_for_backends(v, depth + 1))
    if "$ref" in out:  # annotations beside a $ref (llguidance refuses siblings of a cyclic one)
        out = {
            k: v for k, v in out.items() if k not in ANNOTATIONS or (k == "$schema" and not depth)
        }
    props = out.get("properties")
    if (
        isinstance(props, dict)
        and "additionalProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    if (
        isinstance(props, dict)
        and "patternProperties" not in out
        and out.get("additionalProperties") is False
    ):
        required = out.get("required", [])
        kept = {k: v for k, v in props.items() if v is not False or k in required}
        if len(kept) < len(props):
            out["properties"] = kept
    return out
