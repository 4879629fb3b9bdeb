"""Pure parts of benchmarks/bench_verifier.py: each keyword group's schema needs the verifier
for exactly that keyword (the benchmark measures what it says), and outputs are judged by
``jsonschema``. The generation itself never runs in tests."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from bench_loader import load_benchmark

from radixlm.runtime.grammar.strict import verified_keywords
from radixlm.tool_calls import format_tool_call

bv = load_benchmark("bench_verifier")


@pytest.mark.parametrize("keyword", sorted(bv.KEYWORD_SCHEMAS))
def test_each_group_needs_the_verifier_for_its_keyword(keyword: str) -> None:
    # propertyNames: its lookahead is a ``pattern`` of the names' schema (the plain part goes
    # to the grammar; a plain anchored name pattern needs no verifier)
    extra = ["pattern"] if keyword == "propertyNames" else []
    assert verified_keywords(json.dumps(bv.KEYWORD_SCHEMAS[keyword])) == sorted([keyword, *extra])


@pytest.mark.parametrize("name", sorted(bv.DEAD_END_SCHEMAS))
def test_dead_end_schemas_need_the_verifier_and_admit_an_instance(name: str) -> None:
    schema, instance = bv.DEAD_END_SCHEMAS[name]
    assert verified_keywords(json.dumps(schema))
    assert bv._validates(schema, instance) == []


def _result(text: str, reason: str = "stop", code: str | None = None) -> Any:
    out = SimpleNamespace(output_token_ids=[1, 2], finish_reason=reason, text=text,
                          error_code=code, error="e" if code else None)  # fmt: skip
    return SimpleNamespace(outputs=[out])


def test_outputs_are_judged_by_jsonschema() -> None:
    case = bv.Case("uniqueItems", "uniqueItems", bv.KEYWORD_SCHEMAS["uniqueItems"])
    assert bv.judge(case, 0, _result('{"tags":["a","b","c"]}')).status == "valid"
    assert bv.judge(case, 0, _result('{"tags":["a","b","a"]}')).status == "invalid"
    assert bv.judge(case, 0, _result('{"tags":', "length")).status == "cut"
    dead = _result("", "error", "grammar_dead_end")
    assert bv.judge(case, 0, dead).status == "dead_end"
    tool = bv.Case("tools", "uniqueItems", case.schema, tool=True)
    call = format_tool_call("record", '{"tags":["x","y","z"]}')
    assert bv.judge(tool, 0, _result(call)).status == "valid"
    assert bv.judge(tool, 0, _result("no call")).status == "invalid"
