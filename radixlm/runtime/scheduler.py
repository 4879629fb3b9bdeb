"""Iteration-level continuous batching over the radix cache.

`schedule() -> ScheduledBatch`: running requests (decodes and unfinished prefill chunks) first,
then waiting ones admitted by policy, all under `max_batched_tokens`; the executor runs the batch
(one ragged forward, sampling); `update(batch, StepOutput)` advances the computed tokens, caches
computed pages, appends the sampled tokens (through the output processor) and finishes requests.
Memory pressure: evict unlocked cache leaves (LRU), then retract the running request with the
least progress (its computed full pages go to the radix cache first, so
recomputation is mostly prefix hits). A request that cannot fit even alone fails with an error.

Constrained requests wait in the queue until their grammar is compiled (in the grammar
manager's thread pool): admission skips them without holding up the requests behind them, and a
failed compile fails only that request. A jump-forward leaves several uncomputed tokens; the
next step extends by all of them like any other chunk (`n = min(num_uncomputed, ...)`).

NOTE: invariants kept here
- A request's `pages` are exactly the pages it holds one ref on; the full ones it shares with the
  tree form a root path, so releasing is one `pool.decref(req.pages)`.
- Only full pages are inserted into the tree; the partial last page stays private.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.batch import SampleSlot, ScheduledBatch, ScheduledItem, StepOutput
from radixlm.runtime.constrained import take_compiled_grammar
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.schedule_policy import SchedulePolicy, create_policy

logger = logging.getLogger(__name__)

# `_admit_one` outcomes other than a number of tokens admitted (> 0).
_SKIP, _STOP, _REMOVED = -1, -2, -3

# A waiting request whose next page of prompt beyond its cache hit is being prefilled by a running
# request waits for that prefill to land in the cache instead of computing it again (in-batch
# prefix caching; the leader caches each chunk as it completes, so the wait is a step or a few).


@dataclass
class StepStats:
    num_tokens: int = 0
    num_requests: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    forward_seconds: float = 0.0
    step_seconds: float = 0.0


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        cache: RadixCache,
        config: SchedulerConfig,
        processor: OutputProcessor,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        debug_integrity: bool = False,
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.config = config
        self.processor = processor
        self.max_model_len = max_model_len
        self.page_size = pool.page_size
        self.clock = clock
        self.debug_integrity = debug_integrity
        self.policy: SchedulePolicy = create_policy(config.schedule_policy, config, cache, clock)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.last_step = StepStats()
        self.num_retractions = 0
        self._scheduling_error: str | None = None  # set by `_unschedulable` within a schedule
        self.total_prompt_tokens = 0
        self.total_computed_prompt_tokens = 0
        self.total_generated_tokens = 0
        self.num_forwards = 0  # model forward passes (steps that ran the model)

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request `Engine.submit` has validated (ids in range, prompt non-empty and
        shorter than `max_model_len`)."""
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Finish every branch of `request_id` with reason "abort"; returns whether any existed."""
        found = False
        for req in [r for r in self.waiting if r.request_id == request_id]:
            self.waiting.remove(req)
            if req.grammar_future is not None:
                req.grammar_future.cancel()  # a view: other requests' compiles go on
            self._finish(req, "abort")
            found = True
        for req in [r for r in self.running if r.request_id == request_id]:
            self.running.remove(req)
            self._finish(req, "abort")
            found = True
        return found

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_ready_work(self) -> bool:
        """Work a step can do now: anything running, or a waiting request that is not waiting
        for its grammar to compile (a finished compile counts: the step admits or fails it)."""
        if self.running:
            return True
        return any(r.grammar_future is None or r.grammar_future.done() for r in self.waiting)

    def _poll_grammars(self) -> None:
        """Give each waiting request whose grammar compiled its matcher; fail (only) those
        whose compile failed or timed out."""
        for req in [r for r in self.waiting if r.grammar_pending]:
            error = take_compiled_grammar(req)
            if error is not None:
                self.waiting.remove(req)
                self.processor.fail(req, error)

    # ---- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        items: list[ScheduledItem] = []
        used = 0  # tokens scheduled so far
        chunk_cap = cfg.chunked_prefill_size or math.inf
        self._poll_grammars()
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # retracted or failed earlier in this loop
            n = int(min(req.num_uncomputed, chunk_cap, cfg.max_batched_tokens - used))
            if n <= 0:
                continue
            retractions = self.num_retractions
            try:
                ok = self._ensure_pages(req, req.num_computed_tokens + n, items)
            except Exception as exc:  # noqa: BLE001 - this request's fault, not the batch's
                self._unschedulable(req, items, exc)
                ok = False
            if ok:
                items.append(ScheduledItem(req, n))
            if self.num_retractions != retractions:
                used = sum(i.num_tokens for i in items)  # a retraction dropped an item
            elif ok:
                used += n
        self._admit(items, used)
        if self._scheduling_error is not None:
            message, self._scheduling_error = self._scheduling_error, None
            try:
                self.check_integrity()
            except AssertionError:
                logger.exception("KV page accounting broken after a scheduling error")
                self.fail_all(message)
                items.clear()
        batch = ScheduledBatch(items)
        for k, item in enumerate(items):
            req = item.req
            if req.num_computed_tokens + item.num_tokens == req.num_tokens:
                batch.samples.append(SampleSlot(req, k))
        self._plan_forks(batch)
        return batch

    def _admit(self, items: list[ScheduledItem], used: int) -> None:
        """Admit waiting requests in policy order while a slot, budget and pages last.

        NOTE: admission stops at the first request that cannot get pages (no head-of-line
        skipping): letting smaller requests pass would starve a large one under load."""
        cfg = self.config
        if (
            not self.waiting
            or len(self.running) >= cfg.max_running_requests
            or used >= cfg.max_batched_tokens
        ):
            return  # nothing can be admitted: skip the policy's ordering (prefix lookups)
        inflight = self._inflight_prefixes()
        removed: set[int] = set()
        try:
            order = self.policy.order(self.waiting)
        except Exception:  # noqa: BLE001 - a policy failure must not stop admission
            logger.exception("scheduling policy failed; admitting in arrival order")
            order = list(self.waiting)
        for req in order:
            if req.status is RequestStatus.FINISHED:
                continue  # failed by a scheduling error earlier in this loop
            if len(self.running) >= cfg.max_running_requests:
                break
            budget = cfg.max_batched_tokens - used
            if budget <= 0:
                break
            try:
                n = self._admit_one(req, items, budget, inflight)
            except Exception as exc:  # noqa: BLE001 - this request's fault, not the others'
                self._unschedulable(req, items, exc)
                n = _REMOVED
            if n == _STOP:
                break
            if n in (_SKIP, _REMOVED):
                if n == _REMOVED:
                    removed.add(id(req))
                continue
            removed.add(id(req))
            used += n
        if removed:
            self.waiting = deque(r for r in self.waiting if id(r) not in removed)

    def _admit_one(
        self, req: Request, items: list[ScheduledItem], budget: int, inflight: set[int]
    ) -> int:
        """Admit ``req`` for at most ``budget`` tokens: the tokens scheduled (> 0), or
        ``_SKIP`` (it waits, the ones behind it may go), ``_STOP`` (admission ends here) or
        ``_REMOVED`` (it was failed)."""
        cfg = self.config
        if req.grammar_pending:
            return _SKIP  # its grammar is compiling; the requests behind it go ahead
        if self._shares_inflight_prefix(req, inflight):
            return _SKIP  # wait for the leader's prefill to land in the cache, then hit it
        usable = req.num_tokens - 1
        if req.prompt_logprob_start is not None:
            # Positions whose logits give the wanted prompt logprobs must be computed.
            usable = min(usable, max(0, req.prompt_logprob_start - 1))
        m = self.cache.match_prefix(req.token_ids[:usable], req.namespace)
        self.cache.lock(m.node)
        req.pages = list(m.pages)
        req.page_gen += 1
        req.num_computed_tokens = m.num_tokens
        remaining = req.num_uncomputed
        if cfg.chunked_prefill_size is None:
            # No chunking: the whole prompt, past the budget only when it runs alone.
            if remaining > budget and items:
                self._release(req)
                return _STOP
            n = remaining
        else:
            n = int(min(remaining, cfg.chunked_prefill_size or math.inf, budget))
        if not self._alloc_for_admission(req, req.num_computed_tokens + n):
            self._release(req)
            if not self.running and not items:
                self.processor.fail(req, self._capacity_error(req))
                return _REMOVED
            return _STOP
        if not req.admitted_once:
            req.admitted_once = True
            req.num_cached_tokens = m.num_tokens
            self.total_prompt_tokens += req.num_prompt_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        items.append(ScheduledItem(req, n))
        if self.cache.enabled:
            inflight.update(req.prompt_page_hashes(self.page_size))
        return n

    def _unschedulable(self, req: Request, items: list[ScheduledItem], exc: Exception) -> None:
        """An exception while scheduling ``req`` (admitting it, or giving it pages): fail that
        request only, releasing whatever it held. ``schedule`` then checks the page counts; if
        they are broken it fails every request (last resort, as after a failed step)."""
        logger.exception("scheduling request %s failed; failing it", req.request_id)
        message = f"internal error while scheduling this request: {type(exc).__name__}: {exc}"
        items[:] = [i for i in items if i.req is not req]
        if req in self.running:
            self.running.remove(req)
        self._release(req)
        self.processor.fail(req, message)
        self._scheduling_error = message

    def _plan_forks(self, batch: ScheduledBatch) -> None:
        """n > 1: a request whose prompt completes this step forks its branches. They sample
        from its logits row; in `update` they share its full prompt pages (ref counts), and
        the partial last page is copied (by the executor, after the forward) into a page of
        their own. A branch that gets no page now re-admits later on a prefix hit."""
        ps = self.page_size
        for k, item in enumerate(batch.items):
            parent = item.req
            total = parent.num_computed_tokens + item.num_tokens
            if parent.pending_forks == 0 or total != parent.num_prompt_tokens:
                continue
            partial = total % ps != 0
            for j in range(parent.pending_forks):
                child = self.processor.make_branch(parent, index=j + 1)
                dst = None
                if partial:
                    if self.pool.num_free < 1:
                        self.cache.evict(1)
                    if self.pool.num_free < 1:
                        self.waiting.append(child)
                        continue
                    dst = self.pool.alloc(1)[0]
                    batch.page_copies.append((parent.pages[total // ps], dst))
                # NOTE: running (holding only its copy page) from now on, so that a failed
                # step releases the page; `update` gives it the shared prefix.
                child.pages = [dst] if dst is not None else []
                child.status = RequestStatus.RUNNING
                self.running.append(child)
                batch.forks.append((parent, child, dst))
                batch.samples.append(SampleSlot(child, k))
            parent.pending_forks = 0

    def _inflight_prefixes(self) -> set[int]:
        """Page-prefix hashes of prompts still being prefilled (in-batch prefix sharing)."""
        keys: set[int] = set()
        if self.cache.enabled:
            for r in self.running:
                if r.num_computed_tokens < r.num_prompt_tokens:
                    keys.update(r.prompt_page_hashes(self.page_size))
        return keys

    def _shares_inflight_prefix(self, req: Request, inflight: set[int]) -> bool:
        """True when the page after the cache hit is being computed by a running prefill:
        admitting now would compute it twice."""
        if not inflight or req.num_retractions:
            return False
        hit_pages = self.cache.peek_prefix_len(req.token_ids[: req.num_tokens - 1], req.namespace)
        hit_pages //= self.page_size
        hashes = req.prompt_page_hashes(self.page_size)
        return hit_pages < len(hashes) - 1 and hashes[hit_pages] in inflight

    def _alloc_for_admission(self, req: Request, total_tokens: int) -> bool:
        """Allocate for a new admission, keeping one page of headroom per running request."""
        need = req.pages_needed(total_tokens, self.page_size)
        reserve = len(self.running)
        short = need + reserve - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        if need + reserve > self.pool.num_free:
            return False
        req.pages.extend(self.pool.alloc(need))
        return True

    def _ensure_pages(self, req: Request, total_tokens: int, items: list[ScheduledItem]) -> bool:
        """Give a running request pages for `total_tokens`; evict, then retract, when short."""
        need = req.pages_needed(total_tokens, self.page_size)
        while need > self.pool.num_free:
            short = need - self.pool.num_free
            if self.cache.evict(short) >= short:
                continue
            if len(self.running) == 1:
                # Alone, with every evictable page gone: it can never fit.
                self.running.remove(req)
                self.processor.fail(req, self._capacity_error(req))
                self._release(req)
                return False
            victim = min(self.running, key=lambda r: (r.num_output_tokens, -r.arrival_time))
            self._retract(victim, items)
            if victim is req:
                return False
        req.pages.extend(self.pool.alloc(need))
        return True

    def _capacity_error(self, req: Request) -> str:
        return (
            f"request {req.request_id} needs more KV cache than the whole pool holds "
            f"({req.num_tokens} tokens; pool: {self.pool.num_pages} pages of {self.page_size})"
        )

    def _retract(self, req: Request, items: list[ScheduledItem]) -> None:
        """Preempt: cache its computed full pages, free the rest, recompute later."""
        items[:] = [i for i in items if i.req is not req]
        self.running.remove(req)
        self._cache_computed(req)
        self._release(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        logger.debug("retracted %s (%d tokens)", req.request_id, req.num_tokens)

    def _release(self, req: Request) -> None:
        self.pool.decref(req.pages)
        req.pages = []
        req.page_gen += 1
        req.num_computed_tokens = 0

    def _cache_computed(self, req: Request) -> None:
        """Insert the request's computed full pages into the tree (and adopt the tree's copies)."""
        num_full = req.num_computed_tokens // self.page_size
        if num_full == 0 or not self.cache.enabled:
            return
        full = self.cache.insert_and_adopt(
            req.token_ids[: num_full * self.page_size], req.pages[:num_full], req.namespace
        )
        if full != req.pages[:num_full]:
            req.pages[:num_full] = full
            req.page_gen += 1

    # ---- one iteration -------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, out: StepOutput) -> list[Request]:
        """Apply the executor's output: advance the computed tokens (caching each computed
        prompt chunk for later arrivals), record prompt logprobs, give forked branches their
        prefix, append the sampled tokens; finish and release the requests that ended."""
        for k, item in enumerate(batch.items):
            req = item.req
            if k in out.prompt_logprobs:
                self._record_prompt_logprobs(req, *out.prompt_logprobs[k])
                if k in out.prompt_top_logprobs and req.prompt_top_logprobs is not None:
                    k0 = out.prompt_logprobs[k][0].start + 1 - (req.prompt_logprob_start or 0)
                    tops = out.prompt_top_logprobs[k]
                    req.prompt_top_logprobs[k0 : k0 + len(tops)] = tops
            was_prefill = req.num_computed_tokens < req.num_prompt_tokens
            req.num_computed_tokens += item.num_tokens
            if was_prefill:
                self.total_computed_prompt_tokens += item.num_tokens
                self._cache_computed(req)  # share each computed chunk with later arrivals
        for parent, child, dst in batch.forks:
            num_full = parent.num_computed_tokens // self.page_size
            self.pool.incref(parent.pages[:num_full])
            child.pages = parent.pages[:num_full] + ([dst] if dst is not None else [])
            child.page_gen += 1
            child.num_computed_tokens = parent.num_computed_tokens
            child.admitted_once = True
            child.num_cached_tokens = parent.num_cached_tokens
        appended = self.processor.num_output_tokens
        finished = self.processor.append(
            [s.req for s in batch.samples], out.token_ids, out.logprobs, out.errors
        )
        self.total_generated_tokens += self.processor.num_output_tokens - appended
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                self._finish(req, None)
        self.num_forwards += 1
        num_tokens = batch.num_tokens
        n_prefill = sum(i.num_tokens for i in batch.items if i.num_tokens > 1)
        self.last_step = StepStats(
            num_tokens=num_tokens,
            num_requests=len(batch.items),
            num_prefill_tokens=n_prefill,
            num_decode_tokens=num_tokens - n_prefill,
            forward_seconds=out.forward_seconds,
            step_seconds=out.forward_seconds + out.sample_seconds,
        )
        if self.debug_integrity:
            self.check_integrity()
        return finished

    @staticmethod
    def _record_prompt_logprobs(req: Request, positions: range, values: list[float]) -> None:
        """Entry `p + 1 - start` of `req.prompt_logprobs` is log p(prompt[p + 1])."""
        k = req.prompt_logprob_start
        assert k is not None
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * (req.num_prompt_tokens - k)
        for p, v in zip(positions, values):
            req.prompt_logprobs[p + 1 - k] = v

    def _finish(self, req: Request, reason: str | None) -> None:
        """Release a request's pages (caching its full pages first) and emit its last delta."""
        if req.pages:
            if req.num_computed_tokens > 0:
                self._cache_computed(req)
            self._release(req)
        if reason is not None:
            self.processor.finish(req, reason)

    def fail_request(self, req: Request, message: str) -> None:
        """Fail one request wherever it is and release its pages (not cached: its latest KV
        writes are not trusted)."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        self.processor.fail(req, message)

    def fail_batch(self, batch: ScheduledBatch, message: str) -> None:
        """After an exception in a step: fail the requests of that step (their state is not
        trusted), forked branches included; the others keep running. If the page accounting
        is broken anyway, fail everything (last resort)."""
        reqs = [i.req for i in batch.items] + [child for _, child, _ in batch.forks]
        for req in reqs:
            if req.status is not RequestStatus.FINISHED:
                self.fail_request(req, message)
        try:
            self.check_integrity()
        except AssertionError:
            logger.exception("KV page accounting broken after a failed step; failing everything")
            self.fail_all(message)

    def without(
        self, batch: ScheduledBatch, culprits: list[Request], message: str
    ) -> ScheduledBatch:
        """Fail `culprits` (and the branches they forked this step) and return `batch` without
        them: their items, sample slots, forks and page copies dropped, item indices remapped."""
        bad = {id(r) for r in culprits}
        for parent, child, _ in batch.forks:
            if id(parent) in bad:
                bad.add(id(child))
        kept = [k for k, item in enumerate(batch.items) if id(item.req) not in bad]
        remap = {old: new for new, old in enumerate(kept)}
        out = ScheduledBatch([batch.items[k] for k in kept])
        out.samples = [
            SampleSlot(s.req, remap[s.item])
            for s in batch.samples
            if s.item in remap and id(s.req) not in bad
        ]
        out.forks = [f for f in batch.forks if id(f[1]) not in bad]
        dsts = {dst for _, _, dst in out.forks if dst is not None}
        out.page_copies = [c for c in batch.page_copies if c[1] in dsts]
        for req in [i.req for i in batch.items] + [child for _, child, _ in batch.forks]:
            if id(req) in bad and req.status is not RequestStatus.FINISHED:
                self.fail_request(req, message)
        return out

    def fail_all(self, message: str) -> None:
        """After an internal error: fail every request and release its pages (no caching: the
        state of the failed step is not trusted)."""
        for req in [*self.running, *self.waiting]:
            self._release(req)
            self.processor.fail(req, message)
        self.running.clear()
        self.waiting.clear()

    # ---- introspection -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        held: dict[int, int] = {}
        for req in self.running:
            for p in req.pages:
                held[p] = held.get(p, 0) + 1
        for req in self.waiting:
            assert not req.pages, f"waiting request {req.request_id} holds pages"
        for page in range(self.pool.num_pages):
            assert self.pool.ref(page) == held.get(page, 0), (
                f"page {page}: ref {self.pool.ref(page)} but held by {held.get(page, 0)} requests"
            )
