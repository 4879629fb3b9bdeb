"""Tool calling in the DSL: the model calls a function (arguments valid by construction),
Python runs it, the result goes back as a `tool` message, and the model answers.

    .venv/bin/python examples/tool_calling.py [--url http://127.0.0.1:30000]

`gen(..., tools=TOOLS, tool_choice="required")` constrains the output to calls whose arguments
match each function's `parameters` schema; `s.tool_calls(name)` parses them back. Later turns
use `tool_choice="auto"`: the model answers in text or calls again (the loop is bounded). The same
tools work over HTTP with the `openai` client (see the README). Without `--url` the default
model runs in-process.
"""

from __future__ import annotations

import argparse
from typing import Any

import radixlm as sgl

TEMPERATURES = {"paris": 18, "london": 14, "tokyo": 22, "new york": 16}


def get_weather(city: str, unit: str = "celsius") -> str:
    c = TEMPERATURES.get(city.strip().lower())
    if c is None:
        return f"no data for {city}"
    value = c if unit == "celsius" else round(c * 9 / 5 + 32)
    return f"{value} degrees {unit} in {city}"


def add(a: int, b: int) -> str:
    return str(a + b)


FUNCTIONS = {"get_weather": get_weather, "add": add}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current temperature in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 32},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


@sgl.function
def agent(s, question: str, max_steps: int = 3, max_tokens: int = 48):
    s += sgl.system(sgl.tools_prompt(TOOLS))
    s += sgl.user(question)
    results = []
    choice = "required"  # the first turn must call a tool; later ones may answer in text
    for step in range(max_steps):
        var = f"turn{step}"
        s += sgl.assistant(
            sgl.gen(var, max_tokens=max_tokens, tools=TOOLS, tool_choice=choice,
                    parallel_tool_calls=False)
        )  # fmt: skip
        calls = s.tool_calls(var)
        if not calls:
            s.set_var("answer", sgl.parse_tool_calls(s[var]).content)
            break
        for call in calls:
            result = FUNCTIONS[call.name](**call.args)  # plain Python between generations
            results.append((call.name, call.args, result))
            s += sgl.tool(result)
        choice = "auto"
    return results


def main(argv: list[str] | None = None, backend: Any = None) -> list[Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a radixlm server; default: the model in-process")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-steps", type=int, default=3)
    args = ap.parse_args(argv)
    own = backend is None
    backend = backend or (sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime())
    questions = ["What is the weather in Paris?", "What is 17 plus 25?"]
    try:
        states = agent.run_batch(
            [{"question": q, "max_steps": args.max_steps, "max_tokens": args.max_tokens}
             for q in questions],
            backend=backend, temperature=0,
        )  # fmt: skip
        for q, s in zip(questions, states):
            print(f"Question: {q}")
            for name, call_args, result in s.ret_value or []:
                print(f"  {name}({call_args}) -> {result}")
            print(f"  answer: {s['answer'] if 'answer' in s else '(none)'}   error: {s.error()}")
        return states
    finally:
        if own:
            backend.shutdown()


if __name__ == "__main__":
    main()
