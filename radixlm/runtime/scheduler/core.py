"""Iteration-level continuous batching over the radix cache: the scheduler composed of small
managers, each testable alone.

- `Admission` (admission.py): policy order, budgets, in-batch prefix waits, first chunks.
- `PageManager` (pages.py): allocation with eviction, release, caching computed pages.
- `Retraction` (retraction.py): preemption under memory pressure.
- `ForkPlanner` (forks.py): n > 1 branches.
- `TokenAppender` (appender.py): sampled tokens appended, stop checks.

`schedule() -> ScheduledBatch` only plans: running requests (decodes and unfinished prefill
chunks) first, then waiting ones admitted by policy, all under `max_batched_tokens`; requests it
cannot schedule are finished with an error and returned in `batch.failed` (nothing is emitted
here). `update(batch, StepOutput) -> StepResult` advances the computed tokens, caches computed
pages, gives forked branches their prefix, appends the sampled tokens and releases the requests
that finished; the output processor emits the result.

The scheduler package is the one writer of a request's sequence and page state (see
`radixlm.runtime.request`); a fault while scheduling one request fails that request only.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, HiCache, RadixCache
from radixlm.runtime.batch import (
    PromptLogprobs,
    SampleError,
    SampleSlot,
    ScheduledBatch,
    ScheduledItem,
    SeqUpdate,
    StepOutput,
    StepResult,
)
from radixlm.runtime.constrained import DEAD_END
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.scheduler.admission import Admission, Outcome, take_compiled_grammar
from radixlm.runtime.scheduler.appender import TokenAppender, finish_sequence
from radixlm.runtime.scheduler.drafter import Draft, Drafter, first_token_keys, grammar_draft
from radixlm.runtime.scheduler.forks import ForkPlanner
from radixlm.runtime.scheduler.pages import PageManager
from radixlm.runtime.scheduler.policy import create_policy
from radixlm.runtime.scheduler.retraction import Retraction

logger = logging.getLogger(__name__)


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
        appender: TokenAppender,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        debug_integrity: bool = False,
        hicache: HiCache | None = None,
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.config = config
        self.appender = appender
        self.max_model_len = max_model_len
        self.page_size = pool.page_size
        self.clock = clock
        self.debug_integrity = debug_integrity
        self.hicache = hicache
        self.pages = PageManager(pool, cache, hicache)
        self.policy = create_policy(config.schedule_policy, config, cache, clock, hicache)
        self.admission = Admission(config, cache, self.pages, self.policy)
        self.retraction = Retraction(self.pages)
        self.forks = ForkPlanner(self.pages, appender.init_request)
        # The draft model proposes in the executor; the drafter then only adapts the length.
        self.drafter = (
            Drafter(
                cache,
                config.speculative_ngram_min,
                config.speculative_ngram_max,
                _first_token_keys(appender) if config.speculative_algorithm == "ngram" else None,
            )
            if config.speculative_algorithm is not None
            else None
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.last_step = StepStats()
        self.total_prompt_tokens = 0
        self.total_computed_prompt_tokens = 0
        self.total_generated_tokens = 0
        self.num_forwards = 0  # model forward passes (steps whose forward ran)
        self.total_forward_tokens = 0  # their rows (tokens computed, verified drafts included)
        self.num_spec_decodes = 0  # decoding items scheduled while drafting is on (may draft)
        self.num_drafts = 0  # speculative drafts scheduled (items verifying a draft)
        self.num_draft_tokens = 0  # speculative draft tokens scheduled for verification
        self.num_accepted_draft_tokens = 0  # ... and accepted
        self._failed: list[Request] = []  # finished with an error during this `schedule()`
        self._scheduling_error: str | None = None  # set by `_unschedulable` within a schedule
        self._long_deferred = False  # a running prompt got no tokens in the last step
        self._step_started: float | None = None  # `clock()` when this step's `schedule()` began

    @property
    def num_retractions(self) -> int:
        return self.retraction.num_retractions

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request `Engine.submit` has validated (ids in range, prompt non-empty and
        shorter than `max_model_len`)."""
        self.waiting.append(req)

    def abort(self, request_id: str) -> list[Request]:
        """Finish every branch of `request_id` with reason "abort" (pages released); returns
        the requests finished (with their never-forked branches), empty when none existed."""
        done: list[Request] = []
        for req in [r for r in self.waiting if r.request_id == request_id]:
            self.waiting.remove(req)
            if req.grammar_future is not None:
                req.grammar_future.cancel()  # a view: other requests' compiles go on
            done += self._finish(req, "abort", cache=True)
        for req in [r for r in self.running if r.request_id == request_id]:
            self.running.remove(req)
            done += self._finish(req, "abort", cache=True)
        return done

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_ready_work(self) -> bool:
        """Work a step can do now: anything running, or a waiting request that is not waiting
        for its grammar to compile (a finished compile counts: the step admits or fails it) nor
        for its pages to be read from the second tier."""
        if self.running:
            return True
        loads = self.pages.tier_loads
        return any(
            (r.grammar_future is None or r.grammar_future.done())
            and (loads is None or not loads.pending(r))
            for r in self.waiting
        )

    # ---- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Plan one step (see the module docstring); never emits."""
        self._step_started = self.clock()
        cfg = self.config
        items: list[ScheduledItem] = []
        used = 0  # tokens scheduled so far
        chunk_cap = cfg.chunked_prefill_size or math.inf
        prefill_left = cfg.max_prefill_tokens or math.inf  # the step's prefill tokens left
        self._poll_grammars()
        drafts = self._plan_drafts(chunk_cap)
        # With `max_prefill_tokens`: waiting requests whose prompt would finish within this step
        # go before the running prompts that will not (not two steps in a row: those progress).
        finishing_first = cfg.max_prefill_tokens is not None and not self._long_deferred
        self._long_deferred = False
        for req in self._running_order():
            if req.status is not RequestStatus.RUNNING:
                continue  # retracted or failed earlier in this loop
            if finishing_first and 1 < req.num_uncomputed > min(chunk_cap, prefill_left):
                finishing_first = False
                used, prefill_left = self._admit(items, used, prefill_left, finishing=True)
            n = int(min(req.num_uncomputed, chunk_cap, cfg.max_batched_tokens - used))
            if n > 1:  # a prefill chunk
                n = int(min(n, prefill_left))
            if n <= 0:
                self._long_deferred |= req.num_uncomputed > 1
                continue
            retractions = self.num_retractions
            try:
                draft, reserve = self._draft(req, cfg.max_batched_tokens - used - n, drafts)
                total = req.num_computed_tokens + n + len(draft.tokens) + reserve
                ok = self._ensure_pages(req, total, items)
            except Exception as exc:  # noqa: BLE001 - this request's fault, not the batch's
                self._unschedulable(req, items, exc)
                ok = False
            if ok:
                items.append(
                    ScheduledItem(req, n + len(draft.tokens), draft.tokens, reserve, draft.forced)
                )
            if self.num_retractions != retractions:
                # a retraction dropped an item
                used = sum(i.num_tokens + i.draft_limit for i in items)
                prefill = sum(i.num_tokens for i in items if not i.draft and i.num_tokens > 1)
                prefill_left = (cfg.max_prefill_tokens or math.inf) - prefill
            elif ok:
                used += n + len(draft.tokens) + reserve
                if n > 1:
                    prefill_left -= n
        self._admit(items, used, prefill_left)
        if self._scheduling_error is not None:
            message, self._scheduling_error = self._scheduling_error, None
            try:
                self.check_integrity()
            except AssertionError:
                logger.exception("KV page accounting broken after a scheduling error")
                self._failed += self.fail_all(message)
                items.clear()
        batch = ScheduledBatch(items)
        for k, item in enumerate(items):
            req = item.req
            if item.samples:
                batch.samples.append(SampleSlot(req, k))
        try:
            self.forks.plan(batch, self.running, self.waiting)
        except Exception as exc:  # noqa: BLE001 - fail the parents whose fork failed
            logger.exception("forking branches failed")
            parents = [i.req for i in items if i.req.pending_forks]
            batch, dropped = batch.without(parents)
            self._failed += self._fail(dropped, f"internal error while forking: {exc!r}")
        batch.failed, self._failed = self._failed, []
        return batch

    def _may_draft(self, req: Request) -> bool:
        return (
            self.drafter is not None
            and req.num_uncomputed == 1
            and req.num_output_tokens > 0
            and len(self.running) < self.config.speculative_disable_by_batch_size
        )

    def _draft_limit(self, req: Request, most: int) -> int:
        """The most draft tokens `req` may verify: none past `max_new_tokens` or the context."""
        return min(
            most,
            req.params.max_new_tokens - req.num_output_tokens - 1,
            self.max_model_len - req.num_tokens - 1,
        )

    def _plan_drafts(self, chunk_cap: float) -> dict[int, Draft]:
        """`ngram`: each decoding request's proposal (walked through its grammar:
        `grammar_draft`), sized by the drafter's expected-gain model for this step's rows (on
        its decided tokens; forced runs ride along); by `id(request)`."""
        if self.drafter is None or self.config.speculative_algorithm != "ngram":
            return {}
        cfg = self.config
        proposals: list[tuple[Request, str, Draft]] = []
        base_rows = base_tokens = 0
        step = self.appender.grammar
        manager = step.manager if step is not None and step.manager.jump_forward_enabled else None
        for req in self.running:
            if req.status is not RequestStatus.RUNNING:
                continue
            base_rows += int(min(req.num_uncomputed, chunk_cap))
            if req.num_uncomputed == 1:
                base_tokens += 1
            if not self._may_draft(req):
                continue
            self.num_spec_decodes += 1
            limit = self._draft_limit(req, cfg.speculative_num_draft_tokens)
            try:
                source, draft = self._proposal(req, limit, manager)
            except Exception:  # noqa: BLE001 - a draft is optional: this request decodes plainly
                logger.exception(
                    "drafting for request %s failed; it decodes without", req.request_id
                )
                continue
            if draft.tokens:
                proposals.append((req, source, draft))
        if not proposals:
            return {}
        base_rows = min(base_rows, cfg.max_batched_tokens)
        lengths = self.drafter.plan(
            [(r, src, d.num_decided) for r, src, d in proposals], base_rows, base_tokens
        )
        return {id(r): d.decided(k) for (r, _, d), k in zip(proposals, lengths) if k}

    def _proposal(
        self, req: Request, limit: int, manager: GrammarManager | None
    ) -> tuple[str, Draft]:
        """`req`'s draft and its source, from the drafter's proposal (one token more than
        `limit` is looked up: where a phrase ends) walked through its grammar (`grammar_draft`);
        `manager`: the grammar manager when jump-forward is on."""
        p = self.drafter.propose(req, limit + 1) if limit > 0 and self.drafter else None
        if p is None:
            return "", Draft([])
        if req.grammar is None:
            return p.source, Draft(p.tokens[:limit])
        room = self._draft_limit(req, req.params.max_new_tokens)
        jump = manager.jump_forward if manager is not None else None
        vocab = manager.vocab if manager is not None else None
        return p.source, grammar_draft(req.grammar, p.tokens, limit, room, jump, vocab)

    def _draft(self, req: Request, budget: int, drafts: dict[int, Draft]) -> tuple[Draft, int]:
        """Speculative decoding: draft tokens to verify after a decoding request's last token
        (`ngram`: planned by `_plan_drafts`, cut to `budget`); with a draft model, none yet but
        the number it may propose (pages are reserved for them)."""
        if not self._may_draft(req):
            return Draft([]), 0
        if self.config.speculative_algorithm == "draft":
            assert self.drafter is not None
            self.num_spec_decodes += 1
            most = self.drafter.draft_length(req, self.config.speculative_num_draft_tokens)
            limit = min(self._draft_limit(req, most), budget)
            return Draft([]), max(0, limit)
        return drafts.get(id(req), Draft([])).cut(budget), 0

    def _poll_grammars(self) -> None:
        """Give each waiting request whose grammar compiled its matcher; fail (only) those
        whose compile failed or timed out."""
        for req in [r for r in self.waiting if r.grammar_pending]:
            failed = take_compiled_grammar(req)
            if failed is not None:
                self.waiting.remove(req)
                self._failed += self._finish(req, "error", error=failed.message, code=failed.code)

    def _running_order(self) -> list[Request]:
        """The order running requests take the step's budget in: as they run, or with
        `max_prefill_tokens` decodes first, then prefills shortest remaining first (the one
        closest to its first token is not held back by longer chunks)."""
        if self.config.max_prefill_tokens is None:
            return list(self.running)
        return sorted(self.running, key=lambda r: r.num_uncomputed)

    def _admit(
        self, items: list[ScheduledItem], used: int, prefill_left: float, finishing: bool = False
    ) -> tuple[int, float]:
        """Admit waiting requests in policy order while a slot, budget (the step's tokens and
        prefill tokens) and pages last; with `finishing`, only those whose prompt is computed
        within this step. Returns the step's tokens used and prefill tokens left."""
        cfg = self.config
        if self.pages.tier_loads is not None:
            self.pages.tier_loads.retain(self.waiting)
        if (
            not self.waiting
            or len(self.running) >= cfg.max_running_requests
            or used >= cfg.max_batched_tokens
            or prefill_left <= 0
        ):
            return used, prefill_left  # nothing can be admitted: skip the policy's ordering
        inflight = self.admission.inflight_prefixes(self.running)
        removed: set[int] = set()
        for req in self.admission.order(self.waiting):
            if req.status is RequestStatus.FINISHED:
                continue  # failed by a scheduling error earlier in this loop
            if len(self.running) >= cfg.max_running_requests:
                break
            budget = int(min(cfg.max_batched_tokens - used, prefill_left))
            if budget <= 0:
                break
            try:
                got = self.admission.try_admit(
                    req, self.running, items, budget, inflight, finishing
                )
            except Exception as exc:  # noqa: BLE001 - this request's fault, not the others'
                self._unschedulable(req, items, exc)
                removed.add(id(req))
                continue
            if got.outcome is Outcome.STOP:
                break
            if got.outcome is Outcome.TOO_BIG:
                removed.add(id(req))
                self._failed += self._finish(req, "error", error=self.pages.capacity_error(req))
                continue
            if got.outcome is Outcome.ADMITTED:
                removed.add(id(req))
                used += got.num_tokens
                prefill_left -= got.num_tokens
                if got.first:
                    self.total_prompt_tokens += req.num_prompt_tokens
        if removed:
            self.waiting = deque(r for r in self.waiting if id(r) not in removed)
        return used, prefill_left

    def _ensure_pages(self, req: Request, total_tokens: int, items: list[ScheduledItem]) -> bool:
        """Give a running request pages for `total_tokens`; evict, then retract, when short."""
        while not self.pages.try_grow(req, total_tokens):
            if len(self.running) == 1:
                # Alone, with every evictable page gone: it can never fit.
                self.running.remove(req)
                error = self.pages.capacity_error(req)
                self._failed += self._finish(req, "error", error=error)
                return False
            victim = self.retraction.victim(self.running)
            self.retraction.retract(victim, self.running, self.waiting, items)
            if victim is req:
                return False
        return True

    def _unschedulable(self, req: Request, items: list[ScheduledItem], exc: Exception) -> None:
        """An exception while scheduling ``req`` (admitting it, or giving it pages): fail that
        request only, releasing whatever it held. ``schedule`` then checks the page counts; if
        they are broken it fails every request (last resort, as after a failed step)."""
        logger.exception("scheduling request %s failed; failing it", req.request_id)
        message = f"internal error while scheduling this request: {type(exc).__name__}: {exc}"
        items[:] = [i for i in items if i.req is not req]
        if req in self.running:
            self.running.remove(req)
        self._failed += self._finish(req, "error", error=message)
        self._scheduling_error = message

    # ---- one iteration -------------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, out: StepOutput) -> StepResult:
        """Apply the executor's output: advance the computed tokens (caching each computed
        prompt chunk for later arrivals), give forked branches their prefix, append the sampled
        tokens; finish and release the requests that ended. Returns every request's change,
        the ones `schedule` failed first."""
        result = StepResult.finished(batch.failed)
        for req, message in out.dropped:
            result.updates += [SeqUpdate(r) for r in self._fail([req], message)]
        if not out.ran:
            result.updates += [SeqUpdate(r) for r in self.fail_batch(batch, out.batch_error)]
            return result
        if not batch:
            return result
        # Speculative decoding: only the accepted draft tokens' K/V stand; the slots of the
        # rejected ones are overwritten later (they never count as computed, never cached).
        accepted = {id(batch.samples[j].req): len(t) for j, (t, _) in out.accepted.items()}
        for k, item in enumerate(batch.items):
            req = item.req
            if k in out.prompt_logprobs:
                positions, values = out.prompt_logprobs[k]
                top = out.prompt_top_logprobs.get(k)
                result.prompt_logprobs.append(PromptLogprobs(req, positions, values, top))
            was_prefill = req.num_computed_tokens < req.num_prompt_tokens
            if item.draft:
                n_acc = accepted.get(id(req), 0)
                self.num_drafts += 1
                self.num_draft_tokens += len(item.draft)
                self.num_accepted_draft_tokens += n_acc
                assert self.drafter is not None
                # The acceptance model counts decided tokens (forced ones stand with their run).
                decided = len(item.draft) - len(item.forced)
                self.drafter.record(req, decided, n_acc - sum(p < n_acc for p in item.forced))
                req.num_computed_tokens += item.num_known + n_acc
            else:
                req.num_computed_tokens += item.num_tokens
            if was_prefill:
                self.total_computed_prompt_tokens += item.num_tokens
                self.pages.cache_computed(req)  # share each computed chunk with later arrivals
            self.pages.slide_window(req)
        self.forks.apply(batch)
        appended = self.appender.num_output_tokens
        now = time.monotonic()
        finished: list[Request] = []
        for i, (slot, tok, lp) in enumerate(zip(batch.samples, out.token_ids, out.logprobs)):
            req = slot.req
            if i in out.errors:
                err = out.errors[i]
                if not self._roll_back(req, err):
                    finish_sequence(req, "error", now, error=err.message, code=err.code)
                upd = SeqUpdate(req)
            else:
                drafted = zip(*out.accepted[i]) if i in out.accepted else ()
                try:
                    upd = self.appender.append(req, tok, lp, now, drafted)
                except Exception as exc:  # noqa: BLE001 - grammar / detokenizer: this request
                    logger.exception("request %s failed while appending", req.request_id)
                    finish_sequence(req, "error", now, error=f"internal error: {exc!r}")
                    upd = SeqUpdate(req)
            result.updates.append(upd)
            if req.is_finished:
                finished.append(req)
        self.total_generated_tokens += self.appender.num_output_tokens - appended
        for item in batch.items:
            if (item.draft or item.draft_limit) and not item.req.is_finished:
                self.pages.trim(item.req)  # rejected draft tokens, unused reserved room
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                self._release(req, cache=req.finish_reason != "error")
        self._record_stats(batch, out)
        if self.debug_integrity:
            self.check_integrity()
        return result

    def _roll_back(self, req: Request, err: SampleError) -> bool:
        """A grammar dead end: roll the request back (the appender) and free the pages past
        its shorter sequence, as after a rejected draft. False: it cannot; it fails."""
        if err.code != DEAD_END:
            return False
        try:
            if not self.appender.roll_back(req, err.keyword or "schema"):
                return False
        except Exception:  # noqa: BLE001 - this request's fault: it fails
            logger.exception("request %s failed while rolling back", req.request_id)
            return False
        self.pages.trim(req)
        return True

    def _record_stats(self, batch: ScheduledBatch, out: StepOutput) -> None:
        self.num_forwards += 1
        num_tokens = batch.num_tokens
        self.total_forward_tokens += num_tokens
        if self.drafter is not None:
            # The whole step on this thread, not only its forward and sampling: what a draft
            # costs besides its rows (proposals, walking drafts through grammars, accepting,
            # rolling back) is host work, which on a GPU is a large share of a ~3 ms step.
            started = self._step_started
            seconds = self.clock() - started if started is not None else 0.0
            self.drafter.cost.record(
                num_tokens, max(seconds, out.forward_seconds + out.sample_seconds)
            )
        n_prefill = sum(i.num_tokens for i in batch.items if i.num_tokens > 1)
        self.last_step = StepStats(
            num_tokens=num_tokens,
            num_requests=len(batch.items),
            num_prefill_tokens=n_prefill,
            num_decode_tokens=num_tokens - n_prefill,
            forward_seconds=out.forward_seconds,
            step_seconds=out.forward_seconds + out.sample_seconds,
        )

    # ---- finishing -----------------------------------------------------------------------------

    def _release(self, req: Request, cache: bool) -> None:
        """Give back a request's pages, caching its computed full pages first when `cache`
        (never after an error: its latest KV writes are not trusted)."""
        if req.pages:
            if cache and req.num_computed_tokens > 0:
                self.pages.cache_computed(req)
            self.pages.release(req)

    def _finish(
        self,
        req: Request,
        reason: str,
        error: str | None = None,
        cache: bool = False,
        code: str | None = None,
    ) -> list[Request]:
        """End a request outside sampling (abort, error) — already out of the queues — and
        release its pages; its never-forked branches end with it. Returns them all."""
        self._release(req, cache)
        finish_sequence(req, reason, error=error, code=code)
        branches = self.forks.unforked(req)
        for b in branches:
            b.num_cached_tokens = req.num_cached_tokens
            b.error_code = req.error_code
            finish_sequence(b, reason, req.finish_time, error=req.error)
        return [req, *branches]

    def _fail(self, reqs: list[Request], message: str) -> list[Request]:
        """Fail each unfinished request of `reqs` wherever it is; returns those finished."""
        done: list[Request] = []
        for req in reqs:
            if req.status is RequestStatus.FINISHED:
                continue
            if req in self.running:
                self.running.remove(req)
            if req in self.waiting:
                self.waiting.remove(req)
            done += self._finish(req, "error", error=message)
        return done

    def fail_batch(self, batch: ScheduledBatch, message: str | None) -> list[Request]:
        """After a failed step: fail the requests of that step (their state is not trusted),
        forked branches included; the others keep running. If the page accounting is broken
        anyway, fail everything (last resort)."""
        message = message or "internal error"
        done = self._fail(batch.requests, message)
        try:
            self.check_integrity()
        except AssertionError:
            logger.exception("KV page accounting broken after a failed step; failing everything")
            done += self.fail_all(message)
        return done

    def fail_all(self, message: str) -> list[Request]:
        """After an internal error: fail every request and release its pages (no caching: the
        state of the failed step is not trusted). Returns the requests finished."""
        done: list[Request] = []
        reqs = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        for req in reqs:
            done += self._finish(req, "error", error=message)
        return done

    # ---- introspection -------------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.pages.check_integrity(self.running, list(self.waiting))


def _first_token_keys(appender: TokenAppender) -> dict[int, int] | None:
    """The drafter's leading-space-free n-gram keys, from the tokenizer's bytes (None without
    a tokenizer)."""
    tok = appender.tokenizer
    if tok is None or not appender.eos_token_ids:
        return None
    vocab = TokenVocab.from_tokenizer(tok, len(tok), appender.eos_token_ids)
    return first_token_keys(vocab.token_bytes)
