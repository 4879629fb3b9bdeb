"""n > 1: forking a request's branches once its prompt is computed.

A request whose prompt completes this step forks its `pending_forks` branches. They sample from
its logits row this very step; `apply` (in `update`) gives them one ref on its full prompt pages;
the partial last page is copied by the executor, after the forward, into a page of their own.
A branch that gets no page now waits in the queue and re-admits later on a prefix hit.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence

from radixlm.runtime.batch import SampleSlot, ScheduledBatch
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.scheduler.pages import PageManager


def sibling(parent: Request, index: int) -> Request:
    """A bare request for branch `index` of `parent`'s group: the same prompt, params, sink."""
    return Request(
        request_id=parent.request_id,
        prompt_token_ids=parent.prompt_token_ids,
        params=parent.params,
        sink=parent.sink,
        namespace=parent.namespace,
        index=index,
        arrival_time=parent.arrival_time,
    )


def make_branch(parent: Request, index: int, init: Callable[[Request], None]) -> Request:
    """Branch `index` of `parent`'s group, ready to run: its detokenizer (`init`) and a fork of
    the parent's matcher (taken before the parent's first sample, so the states are equal)."""
    child = sibling(parent, index)
    init(child)
    if parent.grammar is not None:
        assert parent.grammar.num_accepted == 0, "forking a matcher that accepted tokens"
        child.grammar = parent.grammar.fork()
    child.grammar_future = parent.grammar_future
    return child


class ForkPlanner:
    def __init__(self, pages: PageManager, init: Callable[[Request], None]) -> None:
        self.pages = pages
        self.init = init  # attaches a new branch's detokenizer

    def plan(
        self, batch: ScheduledBatch, running: list[Request], waiting: MutableSequence[Request]
    ) -> None:
        """Fork the branches of every item whose prompt completes in `batch`: each runs now
        (holding only its copy page until `apply`) or, without a page, waits."""
        ps = self.pages.page_size
        for k, item in enumerate(batch.items):
            parent = item.req
            total = parent.num_computed_tokens + item.num_tokens
            if parent.pending_forks == 0 or total != parent.num_prompt_tokens:
                continue
            partial = total % ps != 0
            while parent.pending_forks:
                child = make_branch(parent, parent.params.n - parent.pending_forks, self.init)
                parent.pending_forks -= 1  # NOTE: per branch: a fault leaves the rest unforked
                dst = None
                if partial:
                    dst = self.pages.alloc_one()
                    if dst is None:
                        waiting.append(child)
                        continue
                    batch.page_copies.append((parent.pages[total // ps], dst))
                # NOTE: running (holding only its copy page) from now on, so that a failed
                # step releases the page; `apply` gives it the shared prefix.
                child.pages = [dst] if dst is not None else []
                child.status = RequestStatus.RUNNING
                running.append(child)
                batch.forks.append((parent, child, dst))
                batch.samples.append(SampleSlot(child, k))

    def apply(self, batch: ScheduledBatch) -> None:
        """After the forward: each forked branch shares its parent's computed prefix."""
        for parent, child, dst in batch.forks:
            self.pages.share_prefix(parent, child, dst)
            child.admitted_once = True
            child.num_cached_tokens = parent.num_cached_tokens

    @staticmethod
    def unforked(parent: Request) -> list[Request]:
        """The branches `parent` never forked (it finished first), as bare requests that end
        with it (nothing attached: they never run)."""
        n = parent.params.n
        out = [sibling(parent, k) for k in range(n - parent.pending_forks, n)]
        parent.pending_forks = 0
        return out
