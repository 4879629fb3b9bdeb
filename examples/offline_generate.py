"""Offline batch generation: many chats sharing one system prompt, served by one Engine.

    .venv/bin/python examples/offline_generate.py [--max-new-tokens 48]

The conversations share a long system prompt, so after the first one is prefilled the radix
cache serves it to the others (see the cache hit rate printed at the end).
"""

from __future__ import annotations

import argparse
import time

from radixlm import Engine, SamplingParams

SYSTEM = (
    "You are a helpful assistant for a small bakery. Answer in one or two short sentences. "
    "The bakery opens at 7am, closes at 6pm, sells sourdough, croissants and rye bread, "
    "and takes custom cake orders three days in advance."
)
QUESTIONS = [
    "When do you open?",
    "Do you sell croissants?",
    "Can I order a birthday cake for tomorrow?",
    "What kinds of bread do you have?",
    "Are you open in the evening?",
    "What is your best seller?",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="local model dir or .gguf (default: SmolLM2)")
    args = ap.parse_args()

    with Engine(model=args.model, num_threads=2) as engine:
        prompts = [
            engine.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            )
            for q in QUESTIONS
        ]
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
        t0 = time.perf_counter()
        results = engine.generate(prompts, params)
        dt = time.perf_counter() - t0
        for q, r in zip(QUESTIONS, results):
            print(
                f"Q: {q}\nA: {r.text.strip()}  [{r.finish_reason}, cached {r.usage.cached_tokens}"
                f"/{r.usage.prompt_tokens} prompt tokens]\n"
            )
        s = engine.stats()
        n = sum(r.usage.completion_tokens for r in results)
        print(
            f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s); cache hit rate {s.cache_hit_rate:.2f}"
        )


if __name__ == "__main__":
    main()
