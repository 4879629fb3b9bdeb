"""Engine snapshots for live views (the server's `/dashboard`): one dataclass per part.

`take_snapshot(scheduler, options)` runs under the engine lock (`Engine.snapshot`) and costs
O(summary size): O(1) counters the pool, cache and scheduler already maintain, the bounded tree
summary of `radixlm.radix.summary`, and at most `max_requests` request rows. It never walks the
tree or the whole queue. Serializing (and decoding token ids, when shown) is the caller's job,
outside the lock. Rates are differences of the cumulative counters between two snapshots.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from radixlm.radix.hicache import HiCacheStats
from radixlm.radix.summary import SummaryOptions, TreeSummary, namespace_label, summarize
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.scheduler import Scheduler


@dataclass(frozen=True)
class SnapshotOptions:
    tree: SummaryOptions = field(default_factory=SummaryOptions)
    max_requests: int = 48  # request rows (running first, then the head of the queue)


@dataclass(frozen=True)
class MemorySnapshot:
    """KV pages now (free + held + cached == total) and cumulative page events."""

    total_pages: int
    free_pages: int
    held_pages: int  # ref > 0: in use by running requests
    cached_pages: int  # in the tree, unreferenced: evictable
    page_size: int
    evicted_pages: int  # cumulative
    retractions: int  # cumulative


@dataclass(frozen=True)
class RequestView:
    """One request's progress. ``state``: ``prefill`` (computing chunk ``chunk`` of
    ``num_chunks``), ``decoding``, ``retracted`` (preempted, waiting to be re-admitted),
    ``grammar`` (waiting for its grammar to compile) or ``waiting``."""

    request_id: str
    index: int
    state: str
    chunk: int | None
    num_chunks: int | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the radix cache at (first) admission
    computed_prompt_tokens: int  # prompt tokens run through the model so far (past the hit)
    computed_tokens: int  # positions whose KV is computed (prompt and output)
    output_tokens: int
    age_s: float
    namespace: str


@dataclass(frozen=True)
class SchedulerSnapshot:
    num_running: int
    num_waiting: int
    max_running_requests: int
    requests: tuple[RequestView, ...]  # bounded: running first, then the queue's head
    last_step_tokens: int
    last_step_seconds: float


@dataclass(frozen=True)
class CounterSnapshot:
    """Cumulative counters (rates are their differences between snapshots)."""

    prompt_tokens: int  # of admitted requests
    computed_prompt_tokens: int  # run through the model (misses, recomputation)
    generated_tokens: int
    cache_hit_tokens: int
    cache_queried_tokens: int
    num_forwards: int
    spec_drafts: int = 0  # speculative decoding: drafts verified,
    spec_draft_tokens: int = 0  # ... their tokens,
    spec_accepted_tokens: int = 0  # ... and the tokens accepted


@dataclass(frozen=True)
class EngineSnapshot:
    monotonic: float
    wall_time: float
    memory: MemorySnapshot
    scheduler: SchedulerSnapshot
    counters: CounterSnapshot
    tree: TreeSummary
    tier: HiCacheStats | None = None  # the second KV tier, when on


def take_snapshot(scheduler: Scheduler, options: SnapshotOptions | None = None) -> EngineSnapshot:
    """Call with the engine lock held (or on the engine thread); O(summary size)."""
    options = options or SnapshotOptions()
    pool, cache = scheduler.pool, scheduler.cache
    now = time.monotonic()
    memory = MemorySnapshot(
        total_pages=pool.num_pages,
        free_pages=pool.num_free,
        held_pages=pool.num_held,
        cached_pages=pool.num_cached,
        page_size=pool.page_size,
        evicted_pages=cache.evicted_pages,
        retractions=scheduler.num_retractions,
    )
    rows = itertools.islice(
        itertools.chain(scheduler.running, scheduler.waiting), options.max_requests
    )
    sched = SchedulerSnapshot(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        max_running_requests=scheduler.config.max_running_requests,
        requests=tuple(_view(r, scheduler, now) for r in rows),
        last_step_tokens=scheduler.last_step.num_tokens,
        last_step_seconds=scheduler.last_step.step_seconds,
    )
    stats = cache.stats()  # O(1)
    counters = CounterSnapshot(
        prompt_tokens=scheduler.total_prompt_tokens,
        computed_prompt_tokens=scheduler.total_computed_prompt_tokens,
        generated_tokens=scheduler.total_generated_tokens,
        cache_hit_tokens=stats.hit_tokens,
        cache_queried_tokens=stats.queried_tokens,
        num_forwards=scheduler.num_forwards,
        spec_drafts=scheduler.num_drafts,
        spec_draft_tokens=scheduler.num_draft_tokens,
        spec_accepted_tokens=scheduler.num_accepted_draft_tokens,
    )
    return EngineSnapshot(
        monotonic=now,
        wall_time=time.time(),
        memory=memory,
        scheduler=sched,
        counters=counters,
        tree=summarize(cache, options.tree),
        tier=scheduler.hicache.stats() if scheduler.hicache is not None else None,
    )


def _view(req: Request, scheduler: Scheduler, now: float) -> RequestView:
    running = req.status is RequestStatus.RUNNING
    chunk = num_chunks = None
    if running and req.num_computed_tokens < req.num_prompt_tokens:
        state = "prefill"
        cap = scheduler.config.chunked_prefill_size
        todo = max(1, req.num_prompt_tokens - req.num_cached_tokens)
        if cap is None:
            chunk = num_chunks = 1
        else:
            cap = min(cap, scheduler.config.max_batched_tokens)
            num_chunks = math.ceil(todo / cap)
            done = max(0, req.num_computed_tokens - req.num_cached_tokens)
            chunk = min(num_chunks, done // cap + 1)
    elif running:
        state = "decoding"
    elif req.grammar_pending:
        state = "grammar"
    elif req.num_retractions:
        state = "retracted"
    else:
        state = "waiting"
    return RequestView(
        request_id=req.request_id,
        index=req.index,
        state=state,
        chunk=chunk,
        num_chunks=num_chunks,
        prompt_tokens=req.num_prompt_tokens,
        cached_tokens=req.num_cached_tokens,
        computed_prompt_tokens=max(
            0, min(req.num_computed_tokens, req.num_prompt_tokens) - req.num_cached_tokens
        ),
        computed_tokens=req.num_computed_tokens,
        output_tokens=req.num_output_tokens,
        age_s=now - req.arrival_time,
        namespace=namespace_label(req.namespace),
    )
