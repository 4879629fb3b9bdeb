"""OpenAI tool calling against the live server with the official `openai` client: required,
named, parallel, auto, none, streaming (assembled by the client's stream helper), a tool-result
round trip with cached tokens, and bad input. Every argument string is parsed and validated
with `jsonschema` against its function's `parameters`. Greedy and short (small schemas)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 1000},
        "b": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["a", "b"],
}
BOOK = {  # nested object, bounded array, enum, integer bounds
    "type": "object",
    "properties": {
        "guest": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
            },
            "required": ["name", "age"],
        },
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "extras": {"type": "array", "items": {"enum": ["breakfast", "parking"]}, "maxItems": 2},
    },
    "required": ["guest", "nights"],
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "book_hotel": BOOK}
DESCRIPTIONS = {
    "get_weather": "Get the current weather in a city",
    "add": "Add two integers",
    "book_hotel": "Book a hotel room",
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
    for n, s in SCHEMAS.items()
]
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
CH = "/v1/chat/completions"


def _create(oai: Any, **kwargs: Any) -> Any:
    args = {"model": "m", "messages": WEATHER_Q, "tools": TOOLS, "temperature": 0}
    return oai.chat.completions.create(**{**args, "max_tokens": 48, **kwargs})


def _check_calls(calls: Any, allowed: set[str] | None = None) -> list[tuple[str, Any]]:
    """Each call: an id `call_...` (unique), type function, an allowed name, arguments that
    parse and validate against that function's parameters."""
    assert calls, "no tool calls"
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    out = []
    for c in calls:
        assert c.type == "function"
        assert c.function.name in (allowed or SCHEMAS)
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def test_required_makes_one_valid_call(oai: Any) -> None:
    r = _create(oai, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(_check_calls(choice.message.tool_calls)) == 1  # any of the tools is valid


@pytest.mark.parametrize("name", ["add", "book_hotel"])
def test_named_function_is_called(oai: Any, name: str) -> None:
    choice = {"type": "function", "function": {"name": name}}
    r = _create(oai, tool_choice=choice, parallel_tool_calls=False, max_tokens=64)
    assert r.choices[0].finish_reason == "tool_calls"
    [(got, _)] = _check_calls(r.choices[0].message.tool_calls, {name})
    assert got == name


def test_parallel_calls(oai: Any) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris and in London?"}]
    r = _create(oai, messages=messages, tools=TOOLS[:2], tool_choice="required", max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _check_calls(choice.message.tool_calls)
    assert len(calls) >= 2, calls


def test_auto_invariants(oai: Any) -> None:
    """Either text (finish stop / length, no calls) or valid calls (finish tool_calls)."""
    for messages in (WEATHER_Q, [{"role": "user", "content": "Say hello."}]):
        choice = _create(oai, messages=messages, tool_choice="auto", max_tokens=24).choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls)
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert choice.finish_reason in ("stop", "length")
            assert choice.message.content


def test_none_makes_no_calls(oai: Any) -> None:
    choice = _create(oai, tool_choice="none", max_tokens=12).choices[0]
    assert not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length") and choice.message.content


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streaming_assembles_to_the_non_streaming_result(oai: Any, tool_choice: str) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris and in London?"}]
    args = {"messages": messages, "tools": TOOLS[:2], "tool_choice": tool_choice, "max_tokens": 80}
    whole = _create(oai, **args).choices[0]
    kwargs = {"model": "m", "temperature": 0, **args}
    with oai.chat.completions.stream(**kwargs) as stream:
        names = [e.name for e in stream if e.type == "tool_calls.function.arguments.done"]
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason
    assert (streamed.message.content or None) == whole.message.content
    got = [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []]
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert got == want
    assert names == [n for n, _ in want]
    if tool_choice == "required":
        _check_calls(streamed.message.tool_calls)


def test_agent_round_trip_hits_the_cache(oai: Any) -> None:
    first = _create(oai, tool_choice={"type": "function", "function": {"name": "add"}},
                    messages=[{"role": "user", "content": "What is 12 plus 30?"}],
                    parallel_tool_calls=False)  # fmt: skip
    message = first.choices[0].message
    [(_, args)] = _check_calls(message.tool_calls, {"add"})
    result = str(sum(args.values()))
    history = [
        {"role": "user", "content": "What is 12 plus 30?"},
        message.model_dump(exclude_none=True),  # the assistant turn, echoed back as returned
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": result},
    ]
    second = _create(oai, messages=history, tool_choice="auto", max_tokens=16)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the whole first prompt and the generated call are a cached prefix (full pages)
    assert cached >= first.usage.prompt_tokens, (cached, first.usage)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


# Random objects from a small set of property schemas (the grammar tests' kinds of keywords).
PROPERTY_SCHEMAS = {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "active": {"type": "boolean"},
    "nick": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    "when": {"type": "string", "format": "date"},
}


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    keys=st.lists(st.sampled_from(sorted(PROPERTY_SCHEMAS)), min_size=1, max_size=3, unique=True),
    required=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_required_calls_validate_for_random_schemas(
    oai: Any, keys: list[str], required: bool, seed: int
) -> None:
    schema = {"type": "object", "properties": {k: PROPERTY_SCHEMAS[k] for k in keys}}
    if required:
        schema["required"] = keys
    choice = _record_call(oai, schema, seed)
    assert choice.finish_reason == "tool_calls", choice


def _record_call(oai: Any, schema: dict[str, Any], seed: int) -> Any:
    """One required call of a ``record`` tool taking ``schema`` (temperature 1); its arguments
    validate with ``jsonschema`` when it finished. Returns the choice."""
    tool = {"type": "function", "function": {"name": "record", "parameters": schema}}
    r = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Record a person."}],
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=96,
    )
    choice = r.choices[0]
    if choice.finish_reason == "tool_calls":
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema)
    return choice


# Keywords only the verifier enforces (uniqueItems, not): served strictly, like response_format.
UNIQUE = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True,
                 "minItems": 2, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1, 2]}},
    },
    "required": ["tags", "n"],
    "additionalProperties": False,
}  # fmt: skip
EXTERNAL_REF = {"type": "object", "properties": {"x": {"$ref": "https://example.com/s.json"}}}


def _tool(name: str = "f", **fn: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **fn}}


BAD = [
    ("unknown-named-choice", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("tool-without-name", {"tools": [{"type": "function", "function": {"parameters": {}}}]},
     "tools[0].function.name"),
    ("bad-tool-name", {"tools": [_tool("has space")]}, "tools[0].function.name"),
    ("duplicate-names", {"tools": [_tool("f"), _tool("f")]}, "tools[1].function.name"),
    ("parameters-not-object", {"tools": [_tool(parameters=[1, 2])]},
     "tools[0].function.parameters"),
    ("parameters-invalid-schema", {"tools": [_tool(parameters={"type": "nope"})]},
     "tools[0].function.parameters"),
    ("external-ref", {"tools": [_tool(parameters=EXTERNAL_REF)], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ("unknown-tool-choice", {"tool_choice": "always"}, "tool_choice"),
    ("tool-type", {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     "tools[0].type"),
    ("choice-without-tools", {"tools": None, "tool_choice": "required"}, "tool_choice"),
    ("with-response-format", {"tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "extra", "param"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_field(http: Any, name: str, extra: dict[str, Any], param: str) -> None:
    body = {"messages": WEATHER_Q, "tools": [_tool("get_weather", parameters=WEATHER)], **extra}
    r = http.post(CH, json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param.split(".")[0].split("[")[0] in err["message"]


def test_verified_keywords_in_parameters_are_enforced(oai: Any) -> None:
    """Tool parameters that need the verifier are served strictly (no 400): every call's
    arguments validate with ``jsonschema``, sampled at temperature 1 over several seeds."""
    for seed in range(4):
        choice = _record_call(oai, UNIQUE, seed)
        assert choice.finish_reason in ("tool_calls", "length"), choice
