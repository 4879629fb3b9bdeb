"""Branch-solve-merge: fork the question into parallel branches, then merge their answers.

    .venv/bin/python examples/branch_merge.py [--url http://127.0.0.1:30000] [--branches 3]

`s.fork(n)` sends the shared prefix once (so the radix cache holds it), then the branches
generate concurrently (the engine batches them); `join()` gathers each branch's variables into
lists on the parent, and a final generation merges them.
Without `--url` the default model runs in-process.
"""

from __future__ import annotations

import argparse
from typing import Any

import radixlm as sgl

ASPECTS = ["cost", "health", "time", "environment", "comfort"]


@sgl.function
def branch_solve_merge(s, question: str, option: str, branches: int = 3, max_tokens: int = 24):
    s += "You are weighing a decision carefully.\nQuestion: " + question + "\n"
    forks = s.fork(branches)
    forks += lambda i: (
        f"Thinking only about {ASPECTS[i % len(ASPECTS)]}, {option}"
        + sgl.gen("view", max_tokens=max_tokens, stop="\n")
    )
    forks.join()
    for i, view in enumerate(s["view"]):
        s += f"- {ASPECTS[i % len(ASPECTS)]}: {option}{view}\n"
    s += "Weighing all of this, my advice is" + sgl.gen("verdict", max_tokens=max_tokens, stop="\n")


def main(argv: list[str] | None = None, backend: Any = None) -> Any:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a radixlm server; default: the model in-process")
    ap.add_argument("--branches", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--question", default="Should I cycle to work instead of driving?")
    ap.add_argument("--option", default="cycling to work", help="what each branch judges")
    args = ap.parse_args(argv)
    own = backend is None
    backend = backend or (sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime())
    try:
        s = branch_solve_merge.run(
            question=args.question,
            option=args.option,
            branches=args.branches,
            max_tokens=args.max_tokens,
            backend=backend,
            temperature=0,
        )
        print(s.text())
        print(f"error: {s.error()}")
        return s
    finally:
        if own:
            backend.shutdown()


if __name__ == "__main__":
    main()
