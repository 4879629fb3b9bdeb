"""The official JSON-Schema-Test-Suite (drafts 2020-12 and 7) against the grammar backends.

Strict mode promises "over-strict, never invalid": for every suite schema a backend accepts,
every *invalid* instance must be rejected by the compiled grammar, in every compact
serialization tried (the suite's key order and the schema's property order, with and without
``\\u`` escapes). *Valid* instances the grammar also accepts are counted (over-strictness is
allowed and reported). Refused schemas are fine (counted, with the keywords named).

The walk uses ``BYTE_VOCAB`` (one token per byte): exactly "the grammar accepts this string",
and compiles are fast on it.
Data: tests/data/json_schema_test_suite (MIT, see the LICENSE and README there).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from grammar_helpers import BACKENDS, BYTE_VOCAB, grammar_accepts

from radixlm.runtime.grammar.base import CompiledGrammar, get_backend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.strict import find_unsupported

SUITE = Path(__file__).resolve().parents[2] / "data" / "json_schema_test_suite"
DRAFTS = {"draft2020-12": None, "draft7": "http://json-schema.org/draft-07/schema#"}


@dataclass
class Tally:
    groups: int = 0
    skipped: int = 0  # remote references
    refused: int = 0
    accepted: int = 0
    invalid: int = 0
    invalid_rejected: int = 0
    valid: int = 0
    valid_accepted: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    escaped: list[str] = field(default_factory=list)  # invalid instances the grammar accepted


def _groups(draft: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted((SUITE / draft).glob("*.json")):
        for group in json.loads(path.read_text()):
            schema = group["schema"]
            if DRAFTS[draft] and isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": DRAFTS[draft], **schema}
            name = f"{draft}/{path.stem}: {group['description']}"
            out.append((name, {**group, "schema": schema}))
    return out


def _remote_ref(schema: Any) -> bool:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return True
        return any(_remote_ref(v) for v in schema.values())
    return isinstance(schema, list) and any(_remote_ref(v) for v in schema)


def _property_order(schema: Any, order: dict[str, int]) -> dict[str, int]:
    """Property names in order of first appearance in the schema's ``properties`` maps."""
    if isinstance(schema, dict):
        props = schema.get("properties")
        if isinstance(props, dict):
            for name in props:
                order.setdefault(name, len(order))
        for value in schema.values():
            _property_order(value, order)
    elif isinstance(schema, list):
        for value in schema:
            _property_order(value, order)
    return order


def _reordered(value: Any, order: dict[str, int]) -> Any:
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: (order.get(k, len(order)), list(value).index(k)))
        return {k: _reordered(value[k], order) for k in keys}
    if isinstance(value, list):
        return [_reordered(v, order) for v in value]
    return value


def serializations(data: Any, schema: Any) -> list[str]:
    """Distinct compact JSON texts of ``data``."""
    variants = (data, _reordered(data, _property_order(schema, {})))
    texts = [
        json.dumps(v, separators=(",", ":"), ensure_ascii=ascii_)
        for v in variants
        for ascii_ in (False, True)
    ]
    return list(dict.fromkeys(texts))


def run_suite(backend_name: str, draft: str) -> Tally:
    backend = get_backend(backend_name)(BYTE_VOCAB)
    compiled: dict[Constraint, CompiledGrammar] = {}
    t = Tally()
    for name, group in _groups(draft):
        t.groups += 1
        schema = group["schema"]
        if _remote_ref(schema):
            t.skipped += 1
            continue
        try:
            c = Constraint.from_params(json_schema=schema)
            assert c is not None
            backend.validate(c)
            if c not in compiled:
                compiled[c] = backend.compile(c)
        except GrammarError as exc:
            t.refused += 1
            support = getattr(backend, "schema_support", None)  # None: the auto backend
            if isinstance(schema, (dict, bool)) and schema is not False and support is not None:
                try:
                    bad = find_unsupported(schema, support)
                except GrammarError:
                    bad = []
                t.reasons.update({u.keyword.split(" (")[0].split(":")[0] for u in bad} or {"other"})
            else:
                t.reasons["false schema" if schema is False else str(exc)[:40]] += 1
            continue
        t.accepted += 1
        grammar = compiled[c]
        for case in group["tests"]:
            texts = serializations(case["data"], schema)
            hits = [s for s in texts if grammar_accepts(grammar.new_matcher(), s)]
            if case["valid"]:
                t.valid += 1
                t.valid_accepted += bool(hits)
            else:
                t.invalid += 1
                t.invalid_rejected += not hits
                t.escaped.extend(f"{name} / {case['description']}: {s}" for s in hits)
    return t


_TALLIES: dict[tuple[str, str], Tally] = {}


SUITE_BACKENDS = (*BACKENDS, "auto")


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("backend", SUITE_BACKENDS)
def test_suite_invalid_instances_are_rejected(backend: str, draft: str) -> None:
    t = run_suite(backend, draft)
    _TALLIES[(backend, draft)] = t
    assert t.accepted > 0
    assert not t.escaped, "grammar accepts invalid instances:\n" + "\n".join(t.escaped)


def test_auto_accepts_whatever_some_backend_accepts() -> None:
    """`auto` takes the first backend that serves a schema, so per draft it accepts at least as
    many groups as the best single backend (runs after the suite runs above)."""
    if len(_TALLIES) < len(SUITE_BACKENDS) * len(DRAFTS):
        pytest.skip("needs the suite runs above")
    for draft in DRAFTS:
        best = max(_TALLIES[(b, draft)].accepted for b in BACKENDS)
        auto = _TALLIES[("auto", draft)]
        assert auto.accepted >= best, (draft, auto.accepted, best, auto.reasons.most_common(5))
        assert auto.invalid_rejected == auto.invalid
