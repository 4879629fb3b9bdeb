"""Schemas beyond context-free grammars on the real default model: random schemas built from
the keywords only the verifier enforces; every output that finishes validates (jsonschema)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm import Engine, SamplingParams
from radixlm.tool_calls import parse_tool_calls

pytestmark = pytest.mark.slow
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

_ints = st.integers(min_value=-3, max_value=12)
_words = st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f"]), min_size=1, max_size=4,
                  unique=True)  # fmt: skip


@st.composite
def verified_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """An object schema whose properties each use one keyword the verifier enforces."""
    props: dict[str, Any] = {
        "tags": {"type": "array", "items": {"enum": draw(_words) + ["g", "h"]},
                 "uniqueItems": True, "maxItems": 4},
        "n": {"type": "integer", "minimum": -5, "maximum": 20,
              "not": {"enum": draw(st.lists(_ints, min_size=1, max_size=5))}},
        "pick": {"oneOf": [{"type": "integer", "minimum": draw(_ints)},
                           {"type": "integer", "maximum": draw(_ints)}]},
        "name": {"type": "string", "maxLength": 8, "pattern": "^(?!" + draw(_words)[0] + ")"},
        "map": {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,5}$"},
                "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    }  # fmt: skip
    chosen = draw(st.lists(st.sampled_from(sorted(props)), min_size=1, max_size=3, unique=True))
    schema: dict[str, Any] = {"type": "object", "properties": {k: props[k] for k in chosen},
                              "required": chosen[:1], "additionalProperties": False}  # fmt: skip
    if draw(st.booleans()) and "n" in chosen:
        schema["if"] = {"properties": {"n": {"minimum": 5}}}
        schema["then"] = {"required": ["n"]}
    return schema


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> Iterator[Engine]:
    e = Engine(str(default_model_dir), dtype="float32", num_pages=256, grammar_timeout_s=300.0)
    yield e
    e.shutdown()


def _stopped(r: Any) -> bool:
    """The generation finished with "stop" (else "length", or a dead end: the exact schema
    refused every continuation; never another error)."""
    assert r.finish_reason in ("stop", "length", "error"), r.finish_reason
    if r.finish_reason == "error":
        assert r.outputs[0].error_code == "grammar_dead_end", r.error
    return r.finish_reason == "stop"


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI never flakes on a new draw
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schema=verified_schemas(), seed=st.integers(min_value=0, max_value=2**16))
def test_outputs_of_verified_schemas_validate(
    engine: Engine, schema: dict[str, Any], seed: int
) -> None:
    ask = f"Write one JSON value that matches this JSON schema:\n{json.dumps(schema)}"
    prompt = engine.apply_chat_template([{"role": "user", "content": ask}])
    params = SamplingParams(max_new_tokens=96, temperature=1.0, seed=seed,
                            constraint={"json_schema": schema})  # fmt: skip
    [r] = engine.generate([prompt], [params])
    if _stopped(r):
        value = json.loads(r.text)
        jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(value)


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(schema=verified_schemas(), seed=st.integers(min_value=0, max_value=2**16))
def test_tool_arguments_of_verified_schemas_validate(
    engine: Engine, schema: dict[str, Any], seed: int
) -> None:
    """The same schemas as a tool's ``parameters`` (the ``tool_calls`` constraint): every
    finished call's arguments validate."""
    spec = {"mode": "required", "parallel": False,
            "tools": [{"name": "record", "parameters": schema}]}  # fmt: skip
    ask = f"Call record with arguments matching this JSON schema:\n{json.dumps(schema)}"
    prompt = engine.apply_chat_template([{"role": "user", "content": ask}])
    params = SamplingParams(max_new_tokens=128, temperature=1.0, seed=seed,
                            constraint={"tool_calls": spec})  # fmt: skip
    [r] = engine.generate([prompt], [params])
    if _stopped(r):
        [call] = parse_tool_calls(r.text).calls
        assert call.name == "record"
        jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(call.args)
