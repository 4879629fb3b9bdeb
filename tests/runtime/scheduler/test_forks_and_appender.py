"""ForkPlanner and TokenAppender alone: branches share the prompt and copy the partial page;
a branch without a page waits; unforked branches end with their parent. The appender's stops,
in order: stop token, stop string (real tokenizer), length, context length."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.batch import SampleSlot, ScheduledBatch, ScheduledItem
from radixlm.runtime.models.loader import load_tokenizer
from radixlm.runtime.request import Request, RequestStatus, TokenLogprob
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.appender import GrammarRejectedError, TokenAppender
from radixlm.runtime.scheduler.forks import ForkPlanner
from radixlm.runtime.scheduler.pages import PageManager

EOS = 2


def planner(num_pages: int) -> ForkPlanner:
    pool = BlockPool(num_pages, 4)
    return ForkPlanner(PageManager(pool, RadixCache(pool)), init=lambda r: None)


def parent_with_prompt(fp: ForkPlanner, n: int) -> tuple[Request, ScheduledBatch]:
    parent = Request("p", list(range(3, 3 + n)), SamplingParams(max_new_tokens=4, n=3))
    assert fp.pages.try_grow(parent, n)
    parent.status = RequestStatus.RUNNING
    batch = ScheduledBatch([ScheduledItem(parent, n)], samples=[SampleSlot(parent, 0)])
    return parent, batch


def test_branches_sample_from_the_parents_row_and_share_its_pages():
    fp = planner(16)
    parent, batch = parent_with_prompt(fp, 10)
    running, waiting = [parent], deque()
    fp.plan(batch, running, waiting)
    assert parent.pending_forks == 0 and len(batch.forks) == 2 and not waiting
    assert [s.item for s in batch.samples] == [0, 0, 0]
    assert [c.index for _, c, _ in batch.forks] == [1, 2]
    assert [src for src, _ in batch.page_copies] == [parent.pages[2]] * 2
    parent.num_computed_tokens = 10
    fp.apply(batch)
    for _, child, dst in batch.forks:
        assert child.pages == parent.pages[:2] + [dst] and child.num_computed_tokens == 10
    fp.pages.check_integrity(running, [])


def test_a_branch_without_a_page_waits_and_unforked_ones_end_with_the_parent():
    fp = planner(4)
    parent, batch = parent_with_prompt(fp, 10)  # 3 of 4 pages
    running, waiting = [parent], deque()
    fp.plan(batch, running, waiting)
    assert len(batch.forks) == 1 and len(waiting) == 1 and waiting[0].index == 2
    other = Request("q", [1, 2], SamplingParams(n=3))
    assert [b.index for b in fp.unforked(other)] == [1, 2] and other.pending_forks == 0


def appended(app: TokenAppender, req: Request, toks: list[int]) -> str:
    text = ""
    for t in toks:
        if req.is_finished:
            break
        text += app.append(req, t, TokenLogprob(t, -0.5), now=1.0).text
    return text


def test_stop_token_length_and_context_length():
    app = TokenAppender(None, [EOS], max_model_len=6)
    r = Request("a", [5, 6], SamplingParams(max_new_tokens=3))
    appended(app, r, [7, EOS, 9])
    assert (r.finish_reason, r.output_token_ids, r.first_token_time) == ("stop", [7, EOS], 1.0)
    r = Request("b", [5, 6], SamplingParams(max_new_tokens=2))
    upd = app.append(r, 7, TokenLogprob(7, -0.5), now=1.0)
    assert upd.logprobs == [TokenLogprob(7, -0.5)] and not r.is_finished
    appended(app, r, [8, 9])
    assert r.finish_reason == "length" and r.output_token_ids == [7, 8]
    r = Request("c", [5, 6, 7, 8], SamplingParams(max_new_tokens=10))
    appended(app, r, [9, 10, 11])
    assert r.finish_reason == "length" and r.num_tokens == 6  # the context is full
    assert r.output_counts == {9: 1, 10: 1}


def test_a_stop_string_ends_the_sequence_with_the_text_cut(default_model_dir: Path):
    tok = load_tokenizer(default_model_dir)
    app = TokenAppender(tok, [tok.eos_token_id], max_model_len=4096)
    params = SamplingParams(max_new_tokens=50, stop=["world"])
    r = Request("s", tok.encode("Say:"), params)
    app.init_request(r)
    text = appended(app, r, tok.encode(" hello world and more"))
    assert r.finish_reason == "stop" and r.stop_reason == "world"
    assert text == " hello " and r.status is RequestStatus.FINISHED


def test_a_grammar_rejection_is_an_error_of_that_request():
    class Rejecting:
        def advance(self, req, tok, growth):  # type: ignore[no-untyped-def]
            return None

    app = TokenAppender(None, [EOS], 64)
    app.set_grammar(Rejecting())  # type: ignore[arg-type]
    r = Request("g", [1], SamplingParams())
    r.grammar = object()  # type: ignore[assignment]
    with pytest.raises(GrammarRejectedError, match="rejected sampled token 5"):
        app.append(r, 5, None, now=0.0)
