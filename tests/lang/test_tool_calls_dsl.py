"""`gen(..., tools=..., tool_choice=...)` on both backends (in-process and HTTP): the call is
valid for its function's schema, `s.tool_calls` parses it, and a tool result continues."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

import radixlm as sgl

ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 100},
        "b": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["a", "b"],
}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]


@sgl.function
def add_program(s, question: str):
    s += sgl.system(sgl.tools_prompt(TOOLS))
    s += sgl.user(question)
    s += sgl.assistant(
        sgl.gen("call", max_tokens=32, tools=TOOLS, parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "add"}})
    )  # fmt: skip
    [call] = s.tool_calls("call")
    s += sgl.tool(str(call.args["a"] + call.args["b"]))
    s += sgl.assistant(sgl.gen("answer", max_tokens=6))
    return call


def test_named_tool_call_round_trip(backend: Any) -> None:
    s = add_program.run(question="What is 2 plus 3?", backend=backend, temperature=0)
    assert s.error() is None, s.error()
    call = s.ret_value
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ADD)
    assert [m["role"] for m in s.messages()][-2:] == ["tool", "assistant"]


def test_gen_validates_tool_arguments() -> None:
    with pytest.raises(ValueError, match="tool_choice needs tools"):
        sgl.gen("x", tool_choice="required")
    with pytest.raises(ValueError, match="not among the tools"):
        sgl.gen("x", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "z"}})
    with pytest.raises(ValueError, match="tool_choice must be"):
        sgl.gen("x", tools=TOOLS, tool_choice="always")
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", tools=TOOLS, regex="a")
    assert sgl.gen("x", tools=TOOLS, tool_choice="none").params.tool_calls is None
