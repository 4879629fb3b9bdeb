"""Prompts for the end-to-end tests: real text of exact token lengths. A module of its own
(not `conftest`): test modules import it by a name no other test directory uses."""

from __future__ import annotations

SENTENCES = [
    "The radix tree stores each prompt by its tokens, so requests sharing a prefix share memory.",
    "In the morning the fishermen pulled their boats onto the sand and sorted the silver catch.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "She opened the old notebook and found a map drawn in faded blue ink.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Les montagnes étaient couvertes de neige et le ciel était d'un bleu profond.",
    "Rain fell softly on the tin roof while the kettle began to whistle.",
    "A balanced diet includes vegetables, fruits, whole grains and enough water.",
]


def make_prompt_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """Real text of exactly `n_tokens` tokens (varied, so greedy outputs are not degenerate)."""
    ids: list[int] = []
    i = seed
    while len(ids) < n_tokens:
        ids += tokenizer.encode(SENTENCES[i % len(SENTENCES)] + " ", add_special_tokens=False)
        i += 3
    return ids[:n_tokens]


PROMPT_LENGTHS = [5, 9, 17, 33, 64, 100, 150, 230, 300, 420, 512, 600]
NEW_TOKENS = 12
