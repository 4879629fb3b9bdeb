"""The CPU attention op's work plan for one forward (shared by all layers): which query rows
attend to which keys, in which task, and how split outputs are combined.

Formats (see `paged_attention.cpp`):

- `items` `[N, 7]` int32 `(req, row0, nq, pos0, kv_lo, kv_hi, part)`: query rows
  `row0 .. row0 + nq - 1` of request `req` (at positions `pos0...`) over keys `[kv_lo, kv_hi)`,
  causally; `part < 0` writes the output, `part >= 0` a partial (output, log2-sum-exp) at index
  `part`.
- A **shared-prefix item** has `nq = -m`: the `m` decode rows listed at `item_rows[row0 + 1 ..]`
  (requests whose first pages are the same physical pages, e.g. one system prompt) attend
  together to keys `[kv_lo, kv_hi)` of those pages, so each K/V block is read once for all `m`
  (cascade attention). Row `r` writes partial `part + r * item_rows[row0]`.
- `reduces` `[R, 3]` `(row, part0, nparts)`: the row's output from its contiguous partials.

Invariants: every query row is covered by exactly one non-partial item or by the partials of
exactly one reduce; a reduce's partials are all written (no empty key range) and cover the row's
keys `[0, seq_len)` exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.split_kv import num_kv_splits


@dataclass(frozen=True)
class PlanConfig:
    """Knobs of the plan. `force_num_kv_splits` overrides the split-KV heuristic for every
    plain decode row of length >= 2 (tests, benchmarks); `min_shared_tokens = 0` turns
    shared-prefix items off."""

    threads: int = 1
    max_kv_splits: int = 16
    min_tokens_per_split: int = 256
    extend_block: int = 64
    force_num_kv_splits: int | None = None
    min_shared_tokens: int = 128
    # Sliding window W > 0: a query at position p sees keys > p - W only (an item's keys start
    # at its first query's window; the op masks later rows per row). No shared-prefix items.
    window: int = 0
    # An extend of 2 .. this many rows (a speculative verification: the last token + drafts)
    # runs as a shared-prefix item of its own rows over the keys every row sees, plus one short
    # item per later row over its keys among the new ones (0: off; no sliding window).
    small_extend_rows: int = 0


@dataclass
class WorkPlan:
    items: torch.Tensor  # [N, 7] int32
    item_rows: torch.Tensor  # [K] int32
    reduces: torch.Tensor  # [R, 3] int32
    num_parts: int
    num_kv_splits: int  # the most partials of any reduce (1: none)
    num_shared_items: int


def choose_num_kv_splits(
    num_decode: int,
    seq_len: int,
    num_threads: int,
    max_splits: int = 16,
    min_tokens_per_split: int = 256,
) -> int:
    """Split-KV factor for one decode row: one task per decode row (all KV heads), ~4 tasks
    per thread wanted (`radixlm.kernels.split_kv`)."""
    return num_kv_splits(num_decode, 4 * num_threads, seq_len, max_splits, min_tokens_per_split)


def _bounds(lo: int, hi: int, pieces: int) -> list[tuple[int, int]]:
    """`[lo, hi)` cut into `pieces` non-empty runs (`pieces <= hi - lo`)."""
    n = hi - lo
    cuts = [lo + (n * i) // pieces for i in range(pieces + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _shared_groups(
    decode_reqs: list[int],
    seq: list[int],
    page_table: torch.Tensor,
    page_size: int,
    min_tokens: int,
) -> list[tuple[list[int], int]]:
    """Groups of >= 2 decode requests whose first pages are the same physical pages, with the
    number of leading key positions they share (< every member's length, >= `min_tokens`)."""
    if min_tokens <= 0 or len(decode_reqs) < 2:
        return []
    by_first: dict[int, list[int]] = {}
    first = page_table[:, 0].tolist()
    for r in decode_reqs:
        if seq[r] - 1 >= min_tokens:
            by_first.setdefault(first[r], []).append(r)
    groups = []
    for reqs in by_first.values():
        if len(reqs) < 2:
            continue
        pt = page_table[reqs]  # [m, P]
        same_pages = int((pt == pt[0]).to(torch.int32).cumprod(1).sum(1).min())
        shared = min(same_pages * page_size, min(seq[r] for r in reqs) - 1)
        if shared >= min_tokens:
            groups.append((reqs, shared))
    return groups


MIN_EXTEND_BLOCK = 8  # query rows per extend item, at least (the register tiles' rows and more)


def _extend_block(
    extend_lens: list[int], num_items: int, grouped: set[int], cfg: PlanConfig
) -> int:
    """Query rows per extend item: `cfg.extend_block`, or fewer (in steps of 8, down to
    `MIN_EXTEND_BLOCK`) when the step would otherwise have fewer than two items per thread, so
    that a short extend over a long prefix (a returning turn's new message over its history, a
    prompt's last chunk) runs on every thread: each item reads all its keys, which costs less
    than idle threads (measured: 32 rows over 2048 keys, 2 threads, 1.26 -> ~0.7 ms a layer)."""
    extend_rows = sum(e for e in extend_lens if e > 1)
    # items so far (shared-prefix groups, `grouped` rows) + one per other decode row + extends
    items = num_items + sum(1 for r, e in enumerate(extend_lens) if e == 1 and r not in grouped)
    items += sum(-(-e // cfg.extend_block) for e in extend_lens if e > 1)
    target = 2 * cfg.threads
    if extend_rows == 0 or items >= target:
        return cfg.extend_block
    block = -(-extend_rows // target)
    block = -(-block // MIN_EXTEND_BLOCK) * MIN_EXTEND_BLOCK
    return max(MIN_EXTEND_BLOCK, min(cfg.extend_block, block))


def _small_pieces(shared: int, num_small: int, cfg: PlanConfig) -> int:
    """Pieces of a small extend's `shared` keys: ~2 tasks per thread over all small extends."""
    return num_kv_splits(
        num_small, 2 * cfg.threads, shared, cfg.max_kv_splits, cfg.min_tokens_per_split
    )


def _small_extend(
    req: int,
    row0: int,
    e: int,
    n: int,
    num_small: int,
    cfg: PlanConfig,
    num_parts: int,
    items: list[tuple[int, ...]],
    costs: list[int],
    item_rows: list[int],
    reduces: list[tuple[int, int, int]],
) -> int:
    """Plan an extend of `e` (2 .. `cfg.small_extend_rows`) rows at positions `p .. p + e - 1`
    (`p = n - e`): every row sees keys `[0, p]`, read once for all rows by shared-prefix items
    of the request's own rows (the tiles of an extend item cost ~2x a decode row at 2 rows,
    measured), cut into ~2 per thread; row `i >= 1` also sees keys `p + 1 .. p + i` (its own
    item). Returns the new partial count."""
    p = n - e
    shared = p + 1
    n_shared = _small_pieces(shared, num_small, cfg)
    stride = n_shared + 1
    base = num_parts
    offset = len(item_rows)
    item_rows.append(stride)
    item_rows.extend(range(row0, row0 + e))
    for c, (lo, hi) in enumerate(_bounds(0, shared, n_shared)):
        items.append((req, offset, -e, hi - 1, lo, hi, base + c))
        costs.append(e * (hi - lo))
    reduces.append((row0, base, n_shared))  # row 0 sees no new key after its own
    for i in range(1, e):
        reduces.append((row0 + i, base + i * stride, stride))
        items.append((req, row0 + i, 1, p + i, p + 1, p + i + 1, base + i * stride + n_shared))
        costs.append(i)
    return base + e * stride


def plan_work(
    extend_lens: list[int],
    seq_lens: list[int],
    page_table: torch.Tensor,
    page_size: int,
    cfg: PlanConfig,
) -> WorkPlan:
    """The work plan of one forward: `extend_lens[i]` new rows of request `i` (1: a decode
    row), its kv length `seq_lens[i]` after the step; `page_table` `[B, P]` int32 on the host."""
    rows_of: list[int] = []
    row = 0
    for e in extend_lens:
        rows_of.append(row)
        row += e
    decode_reqs = [r for r, e in enumerate(extend_lens) if e == 1]
    num_decode = len(decode_reqs)
    items: list[tuple[int, ...]] = []
    costs: list[int] = []
    item_rows: list[int] = []
    reduces: list[tuple[int, int, int]] = []
    num_parts = 0

    def splits_for(n: int) -> int:
        if cfg.force_num_kv_splits is not None:
            return min(cfg.force_num_kv_splits, n)
        return choose_num_kv_splits(
            num_decode, n, cfg.threads, cfg.max_kv_splits, cfg.min_tokens_per_split
        )

    grouped: set[int] = set()
    num_shared = 0
    groups = (
        []
        if cfg.force_num_kv_splits is not None or cfg.window
        else _shared_groups(decode_reqs, seq_lens, page_table, page_size, cfg.min_shared_tokens)
    )
    for reqs, shared in groups:
        m = len(reqs)
        # Shared keys in chunks of >= min_tokens_per_split, ~2 per thread; each row's own keys
        # in the same number of pieces for every row (so its partials are one strided run).
        n_shared = num_kv_splits(
            1, 2 * cfg.threads, shared, cfg.max_kv_splits, cfg.min_tokens_per_split
        )
        own_min = min(seq_lens[r] - shared for r in reqs)
        own_max = max(seq_lens[r] - shared for r in reqs)
        n_own = max(1, min(splits_for(own_max), own_min))
        stride = n_shared + n_own
        base = num_parts
        num_parts += m * stride
        offset = len(item_rows)
        item_rows.append(stride)
        item_rows.extend(rows_of[r] for r in reqs)
        for c, (lo, hi) in enumerate(_bounds(0, shared, n_shared)):
            items.append((reqs[0], offset, -m, hi - 1, lo, hi, base + c))
            costs.append(m * (hi - lo))
        for i, r in enumerate(reqs):
            n = seq_lens[r]
            p0 = base + i * stride
            reduces.append((rows_of[r], p0, stride))
            for j, (lo, hi) in enumerate(_bounds(shared, n, n_own)):
                items.append((r, rows_of[r], 1, n - 1, lo, hi, p0 + n_shared + j))
                costs.append(hi - lo)
        grouped.update(reqs)
        num_shared += n_shared

    small = [
        r for r, e in enumerate(extend_lens) if 1 < e <= cfg.small_extend_rows and not cfg.window
    ]
    # Only where the step has too few tasks for its threads otherwise: with enough of them an
    # extend item's tiles cost the same or less (8 x (300 + 2..8) rows, measured).
    tasks = len(items) + sum(-(-e // cfg.extend_block) for r, e in enumerate(extend_lens)
                             if r not in grouped)  # fmt: skip
    if tasks >= 2 * cfg.threads:
        small = []
    # ... and whose keys are long enough to cut (one piece on one thread: the tiles are as fast).
    small = [
        r for r in small if _small_pieces(seq_lens[r] - extend_lens[r] + 1, len(small), cfg) > 1
    ]
    for r in small:
        num_parts = _small_extend(
            r, rows_of[r], extend_lens[r], seq_lens[r], len(small), cfg, num_parts, items, costs,
            item_rows, reduces,
        )  # fmt: skip
    grouped.update(small)
    block = _extend_block(extend_lens, len(items), grouped, cfg)
    for r, (e, n) in enumerate(zip(extend_lens, seq_lens)):
        if r in grouped:
            continue
        prefix = n - e
        if e == 1:
            first = max(0, n - cfg.window) if cfg.window else 0
            splits = splits_for(n - first)
            if splits > 1:
                reduces.append((rows_of[r], num_parts, splits))
                for lo, hi in _bounds(first, n, splits):
                    items.append((r, rows_of[r], 1, prefix, lo, hi, num_parts))
                    costs.append(hi - lo)
                    num_parts += 1
            else:
                items.append((r, rows_of[r], 1, prefix, first, n, -1))
                costs.append(n - first)
        else:
            for q0 in range(0, e, block):
                nq = min(block, e - q0)
                pos0 = prefix + q0
                first = max(0, pos0 - cfg.window + 1) if cfg.window else 0
                items.append((r, rows_of[r] + q0, nq, pos0, first, n, -1))
                costs.append(nq * (pos0 + nq - first))
    # Longest first (cost ~ query rows x keys): dynamic hand-out then balances the threads.
    order = sorted(range(len(items)), key=lambda i: -costs[i])
    return WorkPlan(
        items=torch.tensor([items[i] for i in order], dtype=torch.int32).reshape(-1, 7),
        item_rows=torch.tensor(item_rows, dtype=torch.int32),
        reduces=torch.tensor(reduces, dtype=torch.int32).reshape(-1, 3),
        num_parts=num_parts,
        num_kv_splits=max((n for _, _, n in reduces), default=1),
        num_shared_items=num_shared,
    )
