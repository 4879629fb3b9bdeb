"""The split-KV heuristic, one copy for every attention backend: how many pieces to cut a decode
row's KV into so that a decode launch has enough parallel tasks.

A backend states its own task count and target (the CPU op: one task per decode row, ~4 per
thread; Triton: one program per (row, KV head), ~2 per SM); the rule is the same: enough tasks
for the target when the rows alone do not give it, never pieces shorter than
`min_tokens_per_split` tokens (the partial writes and the reduce would dominate), at most
`max_splits`.
"""

from __future__ import annotations

import math


def num_kv_splits(
    num_tasks: int,
    target_tasks: int,
    seq_len: int,
    max_splits: int = 16,
    min_tokens_per_split: int = 256,
) -> int:
    """Split factor (>= 1) for rows of up to `seq_len` tokens giving `num_tasks` tasks unsplit."""
    by_occupancy = math.ceil(target_tasks / max(1, num_tasks))
    by_length = seq_len // max(1, min_tokens_per_split)
    return max(1, min(by_occupancy, by_length, max_splits))
