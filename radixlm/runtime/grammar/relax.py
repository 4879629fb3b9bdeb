"""The context-free relaxation of a JSON schema, and the marks the verifier reads.

No grammar can say "no two items equal", "not this schema", "exactly one of these" or "this
lookahead". ``relax_schema`` splits a normalized schema in two:

- ``grammar``: the schema without those keywords (``uniqueItems``, ``not``, ``propertyNames``,
  ``if`` / ``then`` / ``else``, ``oneOf`` whose branches are not provably disjoint,
  ``unevaluated*`` beside in-place applicators, ``contains``, lookaround ``pattern``), each
  replaced by something that accepts more: the grammar backends compile this;
- ``verify``: the exact schema, where every relaxed schema object carries ``VERIFY_KEY`` (the
  relaxed keywords; an unknown keyword, so validators ignore it): ``verifier.SchemaVerifier``
  checks generated values against it.

Invariant: every instance of the exact schema is an instance of ``grammar`` (a relaxation);
``verify`` accepts exactly the instances of the normalized schema. ``verify`` is None when
nothing was relaxed (then ``grammar`` is the input).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixlm.runtime.grammar.disjoint import one_of_disjoint
from radixlm.runtime.grammar.normalize import normalize_schema
from radixlm.runtime.grammar.patterns import has_lookaround
from radixlm.runtime.grammar.schema_keywords import map_subschemas

VERIFY_KEY = "x-radixlm-verify"
# Keywords that evaluate an instance in place: ``unevaluated*`` beside them needs annotations.
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
             "dependentSchemas", "dependencies")  # fmt: skip
_MAX_DEPTH = 128


@dataclass(frozen=True)
class Relaxed:
    """``grammar``: what the backends compile; ``verify``: the marked exact schema, or None."""

    grammar: Any
    verify: Any | None


def relax_schema(schema: Any) -> Relaxed:
    """Split a normalized schema (2020-12 keywords) as the module docstring says."""
    if not isinstance(schema, dict):
        return Relaxed(schema, None)
    relaxer = _Relaxer(schema)
    grammar, verify = relaxer.node(schema, 0)
    if not relaxer.changed:
        return Relaxed(schema, None)
    # The cases that replaced if / then / else, and anyOf from oneOf, get their siblings
    # distributed into them like any other anyOf.
    return Relaxed(normalize_schema(grammar), verify)


class _Relaxer:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.changed = False

    def node(self, s: Any, depth: int) -> tuple[Any, Any]:
        if not isinstance(s, dict) or depth > _MAX_DEPTH:
            return s, s
        pairs: dict[int, tuple[Any, Any]] = {}

        def both(sub: Any) -> Any:
            pair = self.node(sub, depth + 1)
            pairs[id(pair[0])] = pair
            return pair[0]

        grammar = map_subschemas(s, both)
        verify = map_subschemas(grammar, lambda g: pairs[id(g)][1] if id(g) in pairs else g)
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
        for key in ("not", "propertyNames"):
            if key in out:
                del out[key]
                done.append(key)
        if any(k in out for k in ("contains", "minContains", "maxContains")):
            for key in ("contains", "minContains", "maxContains"):
                out.pop(key, None)
            done.append("contains")
        if isinstance(out.get("pattern"), str) and has_lookaround(out["pattern"]):
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

    @staticmethod
    def _if_cases(s: dict[str, Any]) -> list[Any] | None:
        """``(if and then) or else``: weaker than ``if``/``then``/``else`` (``not if`` is
        dropped from the second case); None when that allows every value."""
        if "if" not in s or ("then" not in s and "else" not in s):
            return None
        then_case = {"allOf": [s["if"], s["then"]]} if "then" in s else s["if"]
        return [then_case, s.get("else", {})]
