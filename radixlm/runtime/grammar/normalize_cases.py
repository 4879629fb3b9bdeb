"""Normalizer rewrites that replace a keyword by the ``anyOf`` of its cases.

Each rewrite lists the cases of one keyword (conjunctions of schemas), merges every case with
the rest of the schema object (``_branches``) and keeps the keyword where a case has no exact
form, a merge is not exact, or the cases are too many:

- ``if`` / ``then`` / ``else`` on a required property with a finite value set, or an ``if``
  that only requires one property: (``if`` holds and ``then``) or (it fails and ``else``);
- ``not``: the cases of its negation (``schema_facts.negation``);
- ``oneOf`` whose branches all have exact negations: each branch and none of the others;
- ``dependentRequired`` / ``dependentSchemas`` / ``dependencies``: each trigger present (with
  its dependency) or absent;
- over-strict, never invalid: any other ``oneOf``, its branches narrowed until provably
  disjoint (``_one_of_made_disjoint``).

The cases of each rewrite are disjoint or their union is exact; ``anyOf`` needs nothing more.
``CaseRewrites`` is a mixin of ``normalize._Normalizer``, whose ``conj`` / ``inline`` /
``disjoint`` / ``subsets`` it uses.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from radixlm.runtime.grammar.disjoint import json_equal, one_of_disjoint
from radixlm.runtime.grammar.schema_facts import (
    MAX_NOT_CASES,
    finite_values,
    negation,
    required_and_forbidden,
)
from radixlm.runtime.grammar.schema_keywords import NON_ASSERTING, Draft

if TYPE_CHECKING:
    from radixlm.runtime.grammar.disjoint import DisjointChecker
    from radixlm.runtime.grammar.subsume import SubsetChecker

_MAX_DEPENDENCIES = 3
_MAX_ONE_OF = 4
_MAX_NARROWED_ONE_OF = 16
_MAX_NARROWINGS = 12
# Keys that stay at a rewritten node instead of being copied into its anyOf branches.
HOST_KEYS = ("$schema", "$id", "$defs", "definitions", "$comment", "title", "description",
             "default", "examples")  # fmt: skip


class CaseRewrites:
    """The rewrites above, as methods ``(schema object, depth) -> schema``."""

    draft: Draft
    disjoint: DisjointChecker
    subsets: SubsetChecker

    if TYPE_CHECKING:

        def conj(self, parts: list[Any], depth: int) -> Any: ...

        def inline(self, s: Any, depth: int) -> Any: ...

    def _branches(self, s: dict[str, Any], cases: list[list[Any]], depth: int) -> Any:
        """``s`` (without the rewritten keywords) as an ``anyOf`` of ``s`` merged with each case's
        schemas; None if a merge is not exact."""
        host = {k: v for k, v in s.items() if k in HOST_KEYS}
        body = {k: v for k, v in s.items() if k not in HOST_KEYS}
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
        siblings = {k: v for k, v in s.items() if k != "oneOf" and k not in HOST_KEYS}
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
