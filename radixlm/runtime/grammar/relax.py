"""The context-free relaxation of a JSON schema, and the marks the verifier reads.

No grammar can say "no two items equal", "not this schema", "exactly one of these" or "this
lookahead". ``relax_schema`` splits a normalized schema in two:

- ``grammar``: the schema without those keywords (``uniqueItems``, ``not``, ``propertyNames``
  (but a map's anchored name ``pattern``, which becomes its ``patternProperties``),
  ``if`` / ``then`` / ``else``, ``oneOf`` whose branches are not provably disjoint,
  ``dependentRequired`` / ``dependentSchemas`` that normalization did not split into cases,
  ``patternProperties`` whose patterns may overlap (one pattern, the ``anyOf`` of the schemas;
  ``allOf`` members with overlapping patterns lose them and their ``additionalProperties``),
  ``unevaluated*`` beside in-place applicators, ``contains``, lookaround ``pattern`` (the
  pattern without its lookarounds where that is plain, ``without_lookarounds``), all but
  one of several ``pattern`` s on one string, a ``minLength`` over 64 beside a ``pattern``), each
  replaced by something that accepts more: the grammar backends compile this;
- ``verify``: the exact schema, where every relaxed schema object carries ``VERIFY_KEY`` (the
  relaxed keywords; an unknown keyword, so validators ignore it): ``verifier.SchemaVerifier``
  checks generated values against it.

Invariant: every instance of the exact schema is an instance of ``grammar`` (a relaxation);
``verify`` accepts exactly the instances of the normalized schema. ``verify`` is None when
nothing was relaxed (then ``grammar`` is the input, or says the same in other words: a map's
name pattern as its ``patternProperties``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.grammar.disjoint import one_of_disjoint
from radixlm.runtime.grammar.normalize import normalize_schema
from radixlm.runtime.grammar.patterns import (
    has_lookaround,
    plainly_anchored,
    without_lookarounds,
)
from radixlm.runtime.grammar.schema_keywords import (
    NON_ASSERTING,
    VALIDATION_KEYWORDS,
    map_subschemas,
    resolve_pointer,
)

VERIFY_KEY = "x-radixlm-verify"
# Keywords that evaluate an instance in place: ``unevaluated*`` beside them needs annotations.
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
             "dependentSchemas", "dependencies")  # fmt: skip
_MAX_DEPTH = 128
# A ``minLength`` above this beside a ``pattern`` goes to the verifier (see ``_relax``).
_MAX_MIN_LENGTH_WITH_PATTERN = 64


@dataclass(frozen=True)
class Relaxed:
    """``grammar``: what the backends compile; ``verify``: the marked exact schema, or None."""

    grammar: Any
    verify: Any | None


def relax_schema(schema: Any, names_as_patterns: bool = True) -> Relaxed:
    """Split a normalized schema (2020-12 keywords) as the module docstring says.
    ``names_as_patterns``: a map's name pattern may become its ``patternProperties`` (False
    for a backend without them: the verifier then checks the names)."""
    if not isinstance(schema, dict):
        return Relaxed(schema, None)
    relaxer = _Relaxer(schema, names_as_patterns)
    grammar, verify = relaxer.node(schema, 0)
    if not relaxer.changed:
        # Nothing relaxed; the grammar may still say something in other words, exactly.
        return Relaxed(grammar if relaxer.rewritten else schema, None)
    # The cases that replaced if / then / else, and anyOf from oneOf, get their siblings
    # distributed into them like any other anyOf.
    return Relaxed(normalize_schema(grammar), verify)


def _names_as_pattern(obj: dict[str, Any], names: Any) -> tuple[dict[str, Any], bool] | None:
    """A map object's ``propertyNames: {pattern: P}`` as the grammar can say it: every name
    matches ``P`` and every value is an ``additionalProperties`` value, so the grammar gets
    ``patternProperties: {P: that}`` and ``additionalProperties: false`` (exact), with ``P``
    anchored ``^...$`` (xgrammar full-matches ``patternProperties`` keys; llguidance searches:
    the same language) and without lookarounds where it has them (``without_lookarounds``: then
    weaker, and verified). Returns ``obj`` rewritten and whether that is exact; None for any
    other object: one with ``properties``, ``patternProperties`` or an in-place applicator
    (names they declare would get two schemas), or other ``propertyNames`` keywords."""
    if not isinstance(names, dict) or not isinstance(names.get("pattern"), str):
        return None
    if any(k not in ("pattern", "type") and k not in NON_ASSERTING for k in names):
        return None
    if names.get("type", "string") != "string":
        return None
    if obj.get("properties") or obj.get("patternProperties") or any(k in obj for k in _IN_PLACE):
        return None
    extra = obj.get("additionalProperties", True)
    if extra is False:
        return obj, True  # no name at all
    # Only a pattern every backend reads as Python does (``without_lookarounds``' conditions).
    pattern, exact = without_lookarounds(names["pattern"]), not has_lookaround(names["pattern"])
    if pattern is None or not plainly_anchored(pattern):
        return None
    value = {} if extra is True else extra
    keyed = {k: v for k, v in obj.items() if k not in ("properties", "patternProperties")}
    return {**keyed, "patternProperties": {pattern: value}, "additionalProperties": False}, exact


class _Relaxer:
    def __init__(self, root: dict[str, Any], names_as_patterns: bool = True) -> None:
        self.root = root
        self.names_as_patterns = names_as_patterns
        self.changed = False  # a keyword was relaxed: the verifier checks it
        self.rewritten = False  # the grammar says a keyword in other words (exactly)
        # Unknown keys that a local ``$ref`` passes through ("#/ddd/x"): schemas may be kept
        # there, out of ``map_subschemas``' reach; they are relaxed too.
        self.ref_keys = _ref_segments(root) - VALIDATION_KEYWORDS - NON_ASSERTING
        self._recursion: dict[str, bool] = {}  # local $ref -> its target reaches itself

    def node(self, s: Any, depth: int) -> tuple[Any, Any]:
        if not isinstance(s, dict) or depth > _MAX_DEPTH:
            return s, s
        pairs: dict[int, tuple[Any, Any]] = {}

        def both(sub: Any) -> Any:
            pair = self.node(sub, depth + 1)
            pairs[id(pair[0])] = pair
            return pair[0]

        grammar = map_subschemas(s, both)
        held = [k for k, v in s.items() if k in self.ref_keys and isinstance(v, dict)]
        for key in held:
            grammar[key] = both(s[key])
        verify = map_subschemas(grammar, lambda g: pairs[id(g)][1] if id(g) in pairs else g)
        for key in held:
            verify[key] = pairs[id(grammar[key])][1]
        grammar, relaxed = self._relax(s, grammar)
        if relaxed:
            self.changed = True
            verify = {**verify, VERIFY_KEY: relaxed}
        return grammar, verify

    def _relax(self, exact: dict[str, Any], g: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``g`` (``exact`` with relaxed subschemas) with this object's non-context-free
        keywords replaced by weaker ones; the keywords replaced."""
        out = dict(g)
        done: list[str] = []
        if out.get("uniqueItems") is True:
            done.append("uniqueItems")
        out.pop("uniqueItems", None)
        if "not" in out:
            del out["not"]
            done.append("not")
        if "propertyNames" in out:
            del out["propertyNames"]  # the exact one decides (the relaxed one lost lookarounds)
            names = exact.get("propertyNames")
            keyed = _names_as_pattern(out, names) if self.names_as_patterns else None
            if keyed is None:
                done.append("propertyNames")
            else:
                out, exact_names = keyed
                self.rewritten = True
                if not exact_names:
                    done.append("propertyNames")
        if any(k in out for k in ("contains", "minContains", "maxContains")):
            for key in ("contains", "minContains", "maxContains"):
                out.pop(key, None)
            done.append("contains")
        patterns = out.get("patternProperties")
        if (
            isinstance(patterns, dict)
            and len(patterns) > 1
            and not _patterns_disjoint(list(patterns))
        ):
            # A name matching several patterns must satisfy each one's schema; the backends
            # refuse overlapping patterns. One pattern for them all, its schema the anyOf.
            union = "|".join(f"(?:{p})" for p in patterns)
            out["patternProperties"] = {union: {"anyOf": list(patterns.values())}}
            done.append("patternProperties")
        own = list(out.get("patternProperties") or {})
        for key in ("allOf", "anyOf", "oneOf"):
            # The backends intersect the patterns of allOf members (and of the object with
            # each anyOf / oneOf branch) and refuse overlapping ones: each member holding
            # such patterns loses patternProperties and additionalProperties (it then allows
            # any other property: weaker).
            members = out.get(key)
            if not isinstance(members, list):
                continue
            held = [m for m in members if isinstance(m, dict) and m.get("patternProperties")]
            if key == "allOf":
                overlap = held and not _patterns_disjoint(
                    [*own, *(p for m in held for p in m["patternProperties"])]
                )
                relaxed = held if overlap else []
            else:
                relaxed = [m for m in held if own and not _patterns_disjoint(
                    [*own, *m["patternProperties"]])]  # fmt: skip
            if relaxed:
                drop = ("patternProperties", "additionalProperties")
                out[key] = [
                    {k: v for k, v in m.items() if k not in drop}
                    if any(m is r for r in relaxed)
                    else m
                    for m in members
                ]
                done.append("patternProperties")
        required, props = out.get("required"), out.get("properties", {})
        if isinstance(required, list) and isinstance(props, dict):
            # Names normalization could not declare (beside a ``$ref``, or matched by patterns
            # relaxed above): declared as ``{}`` (the backends generate declared properties
            # only). Exact with no other rule for them; weaker otherwise (verified).
            missing = [n for n in required if isinstance(n, str) and n not in props]
            extra = out.get("additionalProperties", True)
            if missing and extra is not False:
                out["properties"] = {**props, **{n: {} for n in missing}}
                if extra not in (True, {}) or out.get("patternProperties"):
                    done.append("required")
        members = out.get("allOf")
        if isinstance(members, list) and any(map(self._recursive, members)):
            # A conjunction of recursive references (normalization stops unrolling it at a
            # depth): the backends cannot intersect them. The grammar keeps the first member,
            # alone when the siblings hold recursive references too.
            siblings = [v for k, v in out.items() if k != "allOf" and k not in NON_ASSERTING]
            if any(map(self._holds_recursive, siblings)):
                return {"allOf": members[:1]}, [*done, "allOf"]
            if len(members) > 1:
                out["allOf"] = members = members[:1]
                done.append("allOf")
        own_pattern = isinstance(out.get("pattern"), str)
        held: list[Any] = []
        if isinstance(members, list):
            # Several patterns on one string (own, members', members' $ref targets'):
            # llguidance intersects them and often cannot decide whether the intersection is
            # empty. The grammar keeps one.
            held = [m for m in members if self._pattern_member(m)]
            if held and own_pattern + len(held) > 1:
                keep = None if own_pattern else held[0]
                out["allOf"] = [
                    ({k: v for k, v in m.items() if k != "pattern"} if "pattern" in m else {})
                    if m is not keep and any(m is h for h in held)
                    else m
                    for m in members
                ]
                done.append("pattern")
        bound = out.get("minLength")
        patterned = own_pattern or bool(held)
        if patterned and isinstance(bound, int) and bound > _MAX_MIN_LENGTH_WITH_PATTERN:
            del out["minLength"]  # measured: llguidance cannot decide ^([a-z][0-9])+$ and 99+
            done.append("minLength")
        for key in ("dependentRequired", "dependentSchemas"):  # what normalize left
            if key in out:
                del out[key]
                done.append(key)
        if isinstance(out.get("pattern"), str) and has_lookaround(out["pattern"]):
            looser = without_lookarounds(out["pattern"])  # the grammar keeps what it can
            if looser:
                out["pattern"] = looser
            else:
                del out["pattern"]
            done.append("pattern")
        if any(k in out for k in ("if", "then", "else")):
            cases = self._if_cases(out)
            for key in ("if", "then", "else"):
                out.pop(key, None)
            if cases is not None and "anyOf" not in out:
                out["anyOf"] = cases
            done.append("if")
        if "oneOf" in out and not one_of_disjoint(self.root, exact):
            branches = out.pop("oneOf")
            if "anyOf" not in out:
                out["anyOf"] = branches
            done.append("oneOf")
        for key in ("unevaluatedProperties", "unevaluatedItems"):
            if key in out and any(k in exact for k in _IN_PLACE):
                del out[key]
                done.append(key)
        return out, done

    def _recursive(self, member: Any) -> bool:
        """``member`` is a local ``$ref`` whose target reaches itself through references."""
        ref = member.get("$ref") if isinstance(member, dict) else None
        if not isinstance(ref, str):
            return False
        if ref not in self._recursion:
            self._recursion[ref] = False
            target = resolve_pointer(self.root, ref)
            seen: set[int] = set()
            stack = [target]
            while stack and not self._recursion[ref]:
                node = stack.pop()
                if id(node) in seen or not isinstance(node, (dict, list)):
                    continue
                seen.add(id(node))
                values = list(node.values()) if isinstance(node, dict) else node
                if isinstance(node, dict) and isinstance(node.get("$ref"), str):
                    nxt = resolve_pointer(self.root, node["$ref"])
                    if nxt is not None and nxt is target:
                        self._recursion[ref] = True
                    values.append(nxt)
                stack.extend(values)
        return self._recursion[ref]

    def _holds_recursive(self, value: Any) -> bool:
        """``value`` holds a local ``$ref`` to a recursive target (references not followed)."""
        stack = [value]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if self._recursive(node):
                    return True
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        return False

    def _pattern_member(self, m: Any) -> bool:
        """An ``allOf`` member with a ``pattern``: its own, or (a bare local ``$ref``) its
        target's when that asserts nothing else (the member is then dropped whole)."""
        if not isinstance(m, dict):
            return False
        if isinstance(m.get("pattern"), str):
            return True
        if not isinstance(m.get("$ref"), str) or any(
            k != "$ref" and k not in NON_ASSERTING for k in m
        ):
            return False
        target = resolve_pointer(self.root, m["$ref"])
        return (
            isinstance(target, dict)
            and isinstance(target.get("pattern"), str)
            and all(k == "pattern" or k in NON_ASSERTING for k in target)
        )

    @staticmethod
    def _if_cases(s: dict[str, Any]) -> list[Any] | None:
        """``(if and then) or else``: weaker than ``if``/``then``/``else`` (``not if`` is
        dropped from the second case); None when that allows every value."""
        if "if" not in s or ("then" not in s and "else" not in s):
            return None
        then_case = {"allOf": [s["if"], s["then"]]} if "then" in s else s["if"]
        return [then_case, s.get("else", {})]


_LITERAL = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-/@:,;=!~'\"<> "
)


def _literal_prefix(pattern: str) -> tuple[str, bool] | None:
    """For ``^`` + literal characters (+ ``$``): the literal and whether ``$`` ends it; None
    for any other pattern."""
    if not pattern.startswith("^"):
        return None
    i = 1
    while i < len(pattern) and pattern[i] in _LITERAL:
        i += 1
    if i < len(pattern) and pattern[i] in "*+?{":  # the last literal is quantified
        i -= 1
    literal, rest = pattern[1:i], pattern[i:]
    return literal, rest == "$"


def _patterns_disjoint(patterns: Iterable[str]) -> bool:
    """Provably no name matches two of ``patterns``: each is ``^literal...`` and no two
    literals are prefixes of one another (or two whole ``^literal$`` differ)."""
    heads = [_literal_prefix(p) for p in patterns]
    if any(h is None for h in heads):
        return False
    for i, a in enumerate(heads):
        for b in heads[i + 1 :]:
            assert a is not None and b is not None
            (la, ea), (lb, eb) = a, b
            if la == lb or (la.startswith(lb) and not eb) or (lb.startswith(la) and not ea):
                return False
    return True


def _ref_segments(root: Any) -> set[str]:
    """The path segments of every local ``$ref`` ("#/a/b") in ``root``."""
    out: set[str] = set()
    stack = [root]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/"):
                out.update(p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/"))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out
