"""The CPU attention op's work plan (`kernels/cpu/plan.py`) on random ragged batches with shared
pages: every query row's keys are covered exactly once, by one direct item or by the partials of
exactly one reduce, and every partial is written by exactly one item."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.kernels.cpu.plan import PlanConfig, plan_work

PS = 4


@st.composite
def batches(draw):
    n = draw(st.integers(1, 10))
    shapes, table_rows = [], []
    shared_pages = [100 + 10 * g + i for g in range(3) for i in range(10)]
    next_page = 1000
    for _ in range(n):
        e = draw(st.sampled_from([1, 1, 1, 2, 3, 5, 9, 32, 100]))
        prefix = draw(st.integers(0, 48))
        seq = prefix + e
        pages = []
        g = draw(st.sampled_from([-1, 0, 0, 1, 2]))
        k = draw(st.integers(2, 10)) if g >= 0 else 0
        pages = shared_pages[10 * g : 10 * g + k] if g >= 0 else []
        while len(pages) * PS < seq:
            pages.append(next_page)
            next_page += 1
        shapes.append((e, seq))
        table_rows.append(pages)
    width = max(len(p) for p in table_rows)
    table = torch.zeros((n, width), dtype=torch.int32)
    for i, p in enumerate(table_rows):
        table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    cfg = PlanConfig(
        threads=draw(st.integers(1, 4)),
        min_tokens_per_split=draw(st.sampled_from([4, 8, 256])),
        min_shared_tokens=draw(st.sampled_from([0, 4, 8])),
        extend_block=draw(st.sampled_from([2, 64])),
        small_extend_rows=draw(st.sampled_from([0, 8])),
    )
    return shapes, table, cfg


@settings(max_examples=300, deadline=None)
@given(batches())
def test_every_row_covered_once(case):
    shapes, table, cfg = case
    ext = [e for e, _ in shapes]
    seq = [s for _, s in shapes]
    plan = plan_work(ext, seq, table, PS, cfg)
    rows_of = [sum(ext[:i]) for i in range(len(ext))]
    req_of_row = {rows_of[i] + j: i for i in range(len(ext)) for j in range(ext[i])}
    direct: dict[int, list[tuple[int, int]]] = {}
    parts: dict[int, tuple[int, int, int]] = {}  # part -> (row, lo, hi)
    irows = plan.item_rows.tolist()
    for req, row0, nq, pos0, lo, hi, part in plan.items.tolist():
        if nq < 0:
            stride, members = irows[row0], irows[row0 + 1 : row0 + 1 - nq]
            assert len(members) == -nq >= 2
            for r, row in enumerate(members):
                i = req_of_row[row]
                # decode rows of several requests, or a small extend's own rows
                assert ext[i] == 1 or (i == req and ext[i] <= cfg.small_extend_rows)
                assert hi <= seq[i] - ext[i] + 1
                # the keys read through req's pages are this member's keys
                assert table[req, : -(-hi // PS)].tolist() == table[i, : -(-hi // PS)].tolist()
                assert part + r * stride not in parts
                parts[part + r * stride] = (row, lo, hi)
            continue
        assert lo < hi
        for j in range(nq):
            row = row0 + j
            assert req_of_row[row] == req
            hi_row = min(hi, pos0 + j + 1)  # causal
            if part < 0:
                direct.setdefault(row, []).append((lo, hi_row))
            else:
                assert nq == 1 and part not in parts
                parts[part] = (row, lo, hi_row)
    reduced = set()
    for row, p0, n in plan.reduces.tolist():
        assert row not in reduced and row not in direct
        reduced.add(row)
        spans = sorted(parts.pop(p)[1:] for p in range(p0, p0 + n) if parts[p][0] == row)
        assert len(spans) == n
        direct[row] = spans
    assert not parts  # every partial belongs to a reduce
    for i, (e, s) in enumerate(shapes):
        for j in range(e):
            spans = sorted(direct[rows_of[i] + j])
            pos = s - e + j
            covered = []
            for lo, hi in spans:
                covered.extend(range(lo, hi))
            assert covered == list(range(pos + 1)), (i, j, spans)


def _extend_items(ext: list[int], seq: list[int], threads: int) -> list[int]:
    """Query rows of each item of a plan with every row on its own pages."""
    width = -(-max(seq) // PS)
    table = torch.arange(len(ext) * width, dtype=torch.int32).reshape(len(ext), width)
    plan = plan_work(ext, seq, table, PS, PlanConfig(threads=threads, min_shared_tokens=0))
    return sorted(nq for _, _, nq, *_ in plan.items.tolist())


def test_a_short_extend_over_a_long_prefix_uses_every_thread():
    """32 new rows over 2048 keys (a returning turn): 4 items of 8 rows on 2 threads (2 per
    thread), 2 of 16 on one; long prefills keep 64-row items; decode rows count as items."""
    assert _extend_items([32], [2080], threads=2) == [8, 8, 8, 8]
    assert _extend_items([32], [2080], threads=1) == [16, 16]
    assert _extend_items([100], [2148], threads=2) == [4, 32, 32, 32]
    assert _extend_items([512], [512], threads=2) == [64] * 8
    assert _extend_items([32, 1, 1, 1, 1], [2080, 300, 300, 300, 300], threads=2).count(32) == 1
    assert _extend_items([5], [2053], threads=2) == [5]  # not below 8 rows an item


def test_a_small_extend_alone_is_read_once_by_all_its_rows_and_split():
    """A verification of 4 drafts (5 rows) over 2048 keys, alone in its step: shared-prefix
    items of its own 5 rows over keys [0, 2049) cut for the threads, and one item per later row
    over its new keys; with enough other tasks, one extend item (the tiles) instead."""
    width = -(-2053 // PS)
    table = torch.arange(width, dtype=torch.int32)[None]
    cfg = PlanConfig(threads=2, min_shared_tokens=0, small_extend_rows=8)
    plan = plan_work([5], [2053], table, PS, cfg)
    items = plan.items.tolist()
    shared = sorted((lo, hi) for _, _, nq, _, lo, hi, _ in items if nq == -5)
    assert len(shared) == 4 and shared[0][0] == 0 and shared[-1][1] == 2049
    own = sorted((row0, lo, hi) for _, row0, nq, _, lo, hi, _ in items if nq == 1)
    assert own == [(1, 2049, 2050), (2, 2049, 2051), (3, 2049, 2052), (4, 2049, 2053)]
    assert sorted(r for r, _, _ in plan.reduces.tolist()) == [0, 1, 2, 3, 4]
    table8 = torch.arange(8 * width, dtype=torch.int32).reshape(8, width)
    busy = plan_work([5] * 8, [2053] * 8, table8, PS, cfg)
    assert sorted(nq for _, _, nq, *_ in busy.items.tolist()) == [5] * 8
