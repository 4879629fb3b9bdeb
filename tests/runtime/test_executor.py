"""The executor's persistent page table and batch building against `ForwardBatch.build`."""

from __future__ import annotations

import random

import torch

from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.batch import ScheduledBatch, ScheduledItem
from radixlm.runtime.executor import PageTable, build_forward_batch
from radixlm.runtime.request import Request
from radixlm.runtime.sampling_params import SamplingParams


def _req(rid: str, n_tokens: int, pages: list[int], computed: int) -> Request:
    r = Request(rid, list(range(5, 5 + n_tokens)), SamplingParams(max_new_tokens=4))
    r.pages = list(pages)
    r.num_computed_tokens = computed
    return r


def _check(batch: ScheduledBatch, table: PageTable, ps: int) -> None:
    fb, sample_rows, _ = build_forward_batch(batch, table, ps, torch.device("cpu"))
    ref = ForwardBatch.build(
        [i.req.token_ids[i.req.num_computed_tokens :][: i.num_tokens] for i in batch.items],
        [i.req.num_computed_tokens for i in batch.items],
        [i.req.pages for i in batch.items],
        [[i.num_tokens - 1] if _completes(i) else [] for i in batch.items],
        ps,
        "cpu",
    )
    for name in ("input_ids", "positions", "out_cache_loc", "seq_lens", "prefix_lens"):
        assert torch.equal(getattr(fb, name), getattr(ref, name)), name
    for row, item in enumerate(batch.items):  # entries past a request's pages are padding
        n = len(item.req.pages)
        assert fb.page_table[row, :n].tolist() == item.req.pages
    assert torch.equal(fb.logits_indices, ref.logits_indices)
    done = [k for k, i in enumerate(batch.items) if _completes(i)]
    assert [sample_rows[k] for k in done] == list(range(len(done)))
    assert all(sample_rows[k] == -1 for k in range(len(batch.items)) if k not in done)


def _completes(item: ScheduledItem) -> bool:
    return item.req.num_computed_tokens + item.num_tokens == item.req.num_tokens


def test_page_table_rows_follow_appends_adoption_and_recycling():
    rng = random.Random(0)
    ps = 4
    table = PageTable(rows=2, width=2)  # tiny: forces both kinds of growth
    reqs = [_req(f"r{i}", rng.randrange(3, 30), [], 0) for i in range(6)]
    next_page = 0
    for step in range(40):
        live = [r for r in reqs if rng.random() < 0.7] or reqs[:1]
        items = []
        for r in live:
            if r.num_computed_tokens >= r.num_tokens:
                r.token_ids.append(7)  # a sampled token to decode
            n = min(r.num_tokens - r.num_computed_tokens, rng.randrange(1, 9))
            while len(r.pages) * ps < r.num_computed_tokens + n:
                r.pages.append(next_page)
                next_page += 1
            if step % 7 == 3 and r.pages:
                r.pages[0] = next_page  # adoption: an earlier page replaced
                next_page += 1
                r.page_gen += 1
            items.append(ScheduledItem(r, n))
        batch = ScheduledBatch(items)
        _check(batch, table, ps)
        for it in items:
            it.req.num_computed_tokens += it.num_tokens
