"""Every program in examples/ runs on the real model (in-process, small max_tokens)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_agent_tools_calls_python_tools_between_generations(runtime, capsys):
    agent = load("agent_tools")
    states = agent.main(["--max-tokens", "12", "--max-steps", "3"], backend=runtime)
    assert all(s.error() is None for s in states)
    calculator_run = states[0]  # "What is 15 times 4?"
    calls = calculator_run.ret_value
    assert calls and calls[0][0] in agent.TOOLS
    text = calculator_run.text()
    for tool, arg, observation in calls:  # each tool ran on the generated argument
        assert f"Action: {tool}[{arg}]\nObservation: {observation}\n" in text
        assert observation == agent.TOOLS[tool](arg)
    assert calls[0] == ("calculator", "15 * 4", "60")
    assert calculator_run["answer"] == "60"
    assert "calculator[15 * 4] -> 60" in capsys.readouterr().out


def test_tools_are_plain_python():
    agent = load("agent_tools")
    assert agent.calculator("6 * (3 + 4)") == "42"
    assert agent.calculator("__import__('os')").startswith("error")
    assert agent.lookup("the Eiffel Tower") == agent.FACTS["eiffel tower"]


def test_json_extraction(runtime):
    example = load("json_extraction")
    records = example.main(["--max-tokens", "40"], backend=runtime)
    assert len(records) == len(example.DOCUMENTS)
    import jsonschema

    for record in records:
        person = {k: record[k] for k in ("name", "age", "city")}
        jsonschema.validate(person, example.PERSON_SCHEMA)
        assert record["adult"] in ("yes", "no")
        assert len(record["date"]) == 10
    assert records[0]["name"] == "Alice" and records[0]["age"] == 30
    json.dumps(records)


def test_multi_turn_chat_shares_the_system_prompt(runtime, capsys):
    example = load("multi_turn_chat")
    states = example.main(["--max-tokens", "8"], backend=runtime)
    assert all(s.error() is None for s in states)
    assert all(len(s.messages()) == 5 for s in states)
    out = capsys.readouterr().out
    cached, total = map(int, out.rsplit("radix cache: ", 1)[1].split()[0].split("/"))
    assert cached > total / 2


def test_branch_merge(runtime):
    example = load("branch_merge")
    s = example.main(["--max-tokens", "8", "--branches", "3"], backend=runtime)
    assert s.error() is None
    assert len(s["view"]) == 3
    text = s.text()
    assert text.index("- cost:") < text.index("- health:") < text.index("my advice is")


def test_tool_calling_runs_the_called_functions(runtime, capsys):
    import jsonschema

    example = load("tool_calling")
    states = example.main(["--max-tokens", "40", "--max-steps", "2"], backend=runtime)
    assert all(s.error() is None for s in states)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in example.TOOLS}
    for s in states:
        assert s.ret_value, "the first turn is required to call a tool"
        for name, args, result in s.ret_value:
            jsonschema.validate(args, schemas[name])
            assert result == example.FUNCTIONS[name](**args)
        roles = [m["role"] for m in s.messages()]
        assert roles[:4] == ["system", "user", "assistant", "tool"]
    assert "add(" in capsys.readouterr().out
