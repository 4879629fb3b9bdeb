"""Multi-turn chats that share one system prompt, rendered with the model's chat template.

    .venv/bin/python examples/multi_turn_chat.py [--url http://127.0.0.1:30000]

Every conversation starts with the same long system prompt: `run_batch` finds that constant
prefix by tracing the program and caches it once, and each later turn extends the previous
turn's prompt, so the radix cache serves most prompt tokens (printed at the end).
Without `--url` the default model runs in-process.
"""

from __future__ import annotations

import argparse
from typing import Any

import radixlm as sgl

SYSTEM = (
    "You are the help desk of the Riverside public library. Answer in one short sentence. "
    "The library opens at 9am and closes at 8pm on weekdays, and at 5pm on Saturdays; it is "
    "closed on Sundays. Members may borrow up to 10 books for three weeks, renew twice online, "
    "and reserve study rooms for two hours a day. Membership is free for residents."
)
CONVERSATIONS = [
    ["When do you open?", "And on Saturdays?"],
    ["How many books can I borrow?", "For how long?"],
    ["Is membership free?", "Can I book a study room?"],
    ["Are you open on Sunday?", "What about Monday evening?"],
]


@sgl.function
def chat(s, turns: list[str], max_tokens: int = 24):
    s += sgl.system(SYSTEM)
    for i, question in enumerate(turns):
        with s.user():
            s += question
        with s.assistant():
            s += sgl.gen(f"answer_{i}", max_tokens=max_tokens, stop="\n")


def main(argv: list[str] | None = None, backend: Any = None) -> list[Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a radixlm server; default: the model in-process")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    own = backend is None
    backend = backend or (sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime())
    try:
        states = chat.run_batch(
            [{"turns": turns, "max_tokens": args.max_tokens} for turns in CONVERSATIONS],
            backend=backend,
            temperature=0,
        )
        prompt = cached = 0
        for s in states:
            for message in s.messages()[1:]:
                print(f"{message['role']:>9}: {message['content']}")
            for i in range(len(s.messages()[1:]) // 2):
                meta = s.get_meta_info(f"answer_{i}")
                prompt, cached = prompt + meta["prompt_tokens"], cached + meta["cached_tokens"]
            print(f"    error: {s.error()}\n")
        print(f"prompt tokens served from the radix cache: {cached}/{prompt}")
        return states
    finally:
        if own:
            backend.shutdown()


if __name__ == "__main__":
    main()
