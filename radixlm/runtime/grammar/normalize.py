"""Exact JSON-schema rewrites before compilation: more schemas become enforceable.

``normalize_schema`` returns a schema with the same set of valid instances (under the
schema's own draft, as ``jsonschema`` validates it), built from keywords the backends enforce.
A rewrite that cannot be made exactly is not made: the keyword stays, and strict mode then
refuses it by name. Rewrites, bottom-up:

- ``$ref`` with sibling keywords: siblings dropped before 2019-09 (the validator ignores them),
  else the target inlined and merged with them.
- ``allOf``: members merged into their parent where the intersection is one schema
  (``schema_merge``); unmergeable members stay.
- draft-04 boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` -> the numeric form.
- ``items`` as an array (drafts before 2020-12) -> ``prefixItems``, with ``additionalItems`` ->
  ``items``; ``additionalItems`` where the validator ignores it is dropped.
- ``if`` / ``then`` / ``else``, ``not``, ``oneOf``, ``dependentRequired`` /
  ``dependentSchemas`` / ``dependencies`` -> the ``anyOf`` of their cases, where each case is
  exact (``normalize_cases``).
- ``uniqueItems`` on arrays whose items come from a finite set (``enum`` / ``const`` /
  boolean) of at most 4 values -> an ``enum`` of every array the original schema accepts
  (each checked with ``jsonschema``).
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
left after the above, its branches narrowed until provably disjoint
(``normalize_cases.CaseRewrites._one_of_made_disjoint``).

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

from radixlm.runtime.grammar.disjoint import DisjointChecker, json_equal
from radixlm.runtime.grammar.formats import FORMAT_PATTERNS
from radixlm.runtime.grammar.normalize_cases import HOST_KEYS, CaseRewrites
from radixlm.runtime.grammar.patterns import (
    matches_every_name,
    names_except,
    regex_matches,
)
from radixlm.runtime.grammar.schema_facts import finite_values
from radixlm.runtime.grammar.schema_keywords import (
    ANNOTATIONS,
    DRAFT3_ONLY_FORMATS,
    NON_ASSERTING,
    SPEC_FORMATS,
    VALIDATION_KEYWORDS,
    Draft,
    is_number,
    map_subschemas,
    resolve_pointer,
    strip_annotations,
)
from radixlm.runtime.grammar.schema_merge import merge_schemas
from radixlm.runtime.grammar.subsume import SubsetChecker

_MAX_DEPTH = 64
# References are inlined down to this depth only: merging a conjunction of recursive references
# unrolls them level by level (an ``allOf`` of two cycles of lengths 2 and 3 never repeats a
# single reference), and each level nests the schema text twice: past ~60 levels it passes
# llguidance's JSON nesting limit (128). Below, the ``$ref`` stays (exact; ``relax`` hands an
# ``allOf`` of recursive references to the verifier).
_MAX_INLINE_DEPTH = 40
_MAX_UNIQUE_VALUES = 4
_MAX_UNIQUE_ARRAYS = 128
_MAX_DISTRIBUTED_BYTES = 256 * 1024


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
    return _Normalizer(Draft(body), _movable(schema)).node(copy.deepcopy(body), 0)


def _drop_inner_dialects(s: Any, depth: int) -> Any:
    """``$schema`` below the root of a schema without embedded resources (no ``$id`` there) is
    ignored by validators: dropped, so that such subschemas merge."""
    if not isinstance(s, dict) or depth > _MAX_DEPTH:
        return s
    out = map_subschemas(s, lambda v: _drop_inner_dialects(v, depth + 1))
    if depth and "$schema" in out and "$id" not in out and "id" not in out:
        del out["$schema"]
    return out


class _Normalizer(CaseRewrites):
    def __init__(self, draft: Draft, movable: bool) -> None:
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
        if ref in self._inlining or depth > _MAX_INLINE_DEPTH or not ref.startswith("#/"):
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
            result = (
                merge_schemas(merged, m, lambda parts: self.conj(parts, depth))
                if isinstance(m, dict)
                else None
            )
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
        patterns = s.get("patternProperties", {})
        if not missing or not isinstance(patterns, dict):
            return s
        declared = dict(props)
        for name in missing:
            verdicts = [regex_matches(p, name) for p in patterns]
            if None in verdicts:  # undecided: keep the schema as it is
                return s
            if any(verdicts):  # the matching patterns' schemas apply to it, as they did
                declared[name] = {}
            elif extra is False:  # a required name that no value may have: left as it is
                return s
            else:  # an additional property: additionalProperties' schema applies
                declared[name] = extra if extra is not True else {}
        return {**s, "properties": declared}

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

    def _no_ops(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        """Drop keywords that assert nothing: a ``format`` that the schema's draft does not
        define (none does, or only draft 3 and the schema is later: validators treat it as an
        annotation; defined formats stay and must be enforced exactly) and
        ``uniqueItems: false``."""
        fmt = s.get("format")
        draft3 = self.draft.cls.__name__ == "Draft3Validator"
        undefined = fmt not in SPEC_FORMATS or (fmt in DRAFT3_ONLY_FORMATS and not draft3)
        drop = {"format"} if isinstance(fmt, str) and undefined else set()
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
        host = {k: v for k, v in s.items() if k in HOST_KEYS}
        rest = {k: v for k, v in s.items() if k != "$ref" and k not in HOST_KEYS}
        merged = self.conj([target, rest], depth)
        if not isinstance(merged, dict) or "allOf" in merged:
            return s if merged is not False else False
        return {**host, **merged}

    def _distribute(self, s: dict[str, Any], depth: int) -> Any:
        """``{S, anyOf/oneOf: [B...]}`` -> ``{anyOf/oneOf: [S and B, ...]}`` (exact; the backends
        ignore keywords beside a combinator)."""
        keys = [k for k in ("anyOf", "oneOf") if isinstance(s.get(k), list)]
        siblings = {k: v for k, v in s.items() if k not in HOST_KEYS and k not in keys}
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
        host = {k: v for k, v in s.items() if k in HOST_KEYS}
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


def lower_for_backends(schema: Any, depth: int = 0, close: bool = True) -> Any:
    """Make "declared properties only" explicit, then use it. Every backend generates only
    declared properties (over-strict, like OpenAI's strict mode): a schema with ``properties``
    and no ``additionalProperties`` / ``unevaluatedProperties`` gets ``additionalProperties:
    false`` (xgrammar and outlines behave so anyway; llguidance would otherwise generate extra
    keys). Then ``properties`` entries that are ``false`` are dropped where the property cannot
    be generated anyway (the backends cannot compile ``false``). A ``false`` entry that is also
    required makes the object unsatisfiable: it is kept (the backend then refuses the
    schema). ``allOf`` members of an object that bounds its names itself (``properties``,
    ``additionalProperties``) are not closed (``close``): the object's rule says which names
    may appear, and a closed member would forbid names the object allows."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return schema
    out = map_subschemas(schema, lambda v: lower_for_backends(v, depth + 1))
    if isinstance(schema.get("allOf"), list) and (
        isinstance(schema.get("properties"), dict) or "additionalProperties" in schema
    ):
        out["allOf"] = [lower_for_backends(v, depth + 1, close=False) for v in schema["allOf"]]
    if "$ref" in out:  # annotations beside a $ref (llguidance refuses siblings of a cyclic one)
        out = {
            k: v for k, v in out.items() if k not in ANNOTATIONS or (k == "$schema" and not depth)
        }
    props = out.get("properties")
    if (
        close
        and isinstance(props, dict)
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
