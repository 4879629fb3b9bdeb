"""A ReAct-style agent: the model picks a tool, Python runs it, the observation goes back in.

    .venv/bin/python examples/agent_tools.py [--url http://127.0.0.1:30000] [--max-steps 4]

Each step generates a thought, `select`s the tool among the known ones (so the action is always
valid), generates the tool's argument, and calls the tool in Python between generations. Every
step's prompt extends the previous one, so the radix cache serves the history (see
`cached_tokens` in the output). Without `--url` the default model runs in-process.
"""

from __future__ import annotations

import argparse
import ast
import operator
from typing import Any

import radixlm as sgl

FACTS = {
    "eiffel tower": "The Eiffel Tower is 330 metres tall.",
    "mount everest": "Mount Everest is 8849 metres tall.",
    "python": "Python was created by Guido van Rossum in 1991.",
}
_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.USub: operator.neg,
}  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluate + - * / on numbers (no names, no calls)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def lookup(topic: str) -> str:
    key = topic.strip().lower()
    return next((fact for name, fact in FACTS.items() if name in key or key in name), "unknown")


TOOLS = {"calculator": calculator, "lookup": lookup}

EXAMPLE = """Answer the question using tools, one action per step.
Tools: calculator[arithmetic expression], lookup[topic], finish[final answer].

Question: How tall is Mount Everest?
Thought: I should look it up.
Action: lookup[Mount Everest]
Observation: Mount Everest is 8849 metres tall.
Thought: I know the answer.
Action: finish[8849 metres]

Question: What is 12 times 7?
Thought: I need to multiply 12 by 7.
Action: calculator[12 * 7]
Observation: 84
Thought: I know the answer.
Action: finish[84]

Question: What is 9 plus 16?
Thought: I need to add 9 and 16.
Action: calculator[9 + 16]
Observation: 25
Thought: I know the answer.
Action: finish[25]

"""


@sgl.function
def react_agent(s, question: str, max_steps: int = 4, max_tokens: int = 16):
    s += EXAMPLE + "Question: " + question + "\n"
    calls: list[tuple[str, str, str]] = []
    for _ in range(max_steps):
        s += "Thought:" + sgl.gen("thought", max_tokens=max_tokens, stop="\n") + "\n"
        s += "Action: " + sgl.select("tool", ["calculator", "lookup", "finish"]) + "["
        s += sgl.gen("arg", max_tokens=max_tokens, stop=["]", "\n"]) + "]\n"
        tool, arg = s["tool"], s["arg"].strip()
        if tool == "finish":
            s.set_var("answer", arg)
            break
        observation = TOOLS[tool](arg)  # plain Python between two generations
        calls.append((tool, arg, observation))
        s += "Observation: " + observation + "\n"
    return calls


def main(argv: list[str] | None = None, backend: Any = None) -> list[Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a radixlm server; default: the model in-process")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    own = backend is None
    backend = backend or (sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime())
    questions = ["What is 15 times 4?", "How tall is the Eiffel Tower?"]
    try:
        states = react_agent.run_batch(
            [{"question": q, "max_steps": args.max_steps, "max_tokens": args.max_tokens}
             for q in questions],
            backend=backend, temperature=0,
        )  # fmt: skip
        for q, s in zip(questions, states):
            print(f"Question: {q}")
            for tool, arg, obs in s.ret_value or []:
                print(f"  {tool}[{arg}] -> {obs}")
            answer = s["answer"] if "answer" in s else "(no answer)"
            print(f"  answer: {answer}   error: {s.error()}")
        return states
    finally:
        if own:
            backend.shutdown()


if __name__ == "__main__":
    main()
