"""Engine: the public entry point. The step loop runs in its own thread.

Callers on any thread (or an asyncio loop) submit requests through a queue; the loop thread alone
touches the scheduler, cache and model. Results come back through per-request sinks: a
`threading` queue for `generate`/`stream`, an `asyncio.Queue` for the async variants.

Constrained requests: `submit` validates the constraint on the caller's thread (a `ValueError`
naming the problem, nothing queued) and starts its compile in the grammar manager's thread pool;
the future's completion wakes the loop, which never waits on a compile.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Sequence
from typing import Any

from radixlm.config import EngineConfig
from radixlm.runtime.core_factory import EngineParts
from radixlm.runtime.engine_loop import EngineLoop
from radixlm.runtime.errors import EngineDeadError, RequestValidationError
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.observe import EngineSnapshot, SnapshotOptions, take_snapshot
from radixlm.runtime.outputs import Completion, EngineStats, GenerateResult, Usage
from radixlm.runtime.request import Request, RequestOutput
from radixlm.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class Engine:
    """`Engine(model=None, dtype="bfloat16", **config)`; see `EngineConfig` for the knobs.

    The thin front: validation and submission, the sync and async APIs, stats. The wiring is
    `EngineParts` (core_factory.py); the loop thread is `EngineLoop` (engine_loop.py)."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, dtype=dtype, **kwargs)
        parts = self.parts = EngineParts(self.config)
        self.model_dir = parts.model_dir
        self.tokenizer = parts.tokenizer
        self.model_info = parts.model_info
        self.device = parts.device
        self.runner = parts.runner
        self.max_model_len = parts.max_model_len
        self.pool, self.cache = parts.pool, parts.cache
        self.eos_token_ids = parts.eos_token_ids
        self.scheduler, self.executor = parts.scheduler, parts.executor
        self.processor, self.core = parts.processor, parts.core
        self._loop = EngineLoop(parts)
        if self.scheduler.pages.tier_loads is not None:
            # a finished background read of tier pages makes its request admissible
            self.scheduler.pages.tier_loads.on_done = lambda: self._loop.put("wake")
        # The startup's objects (model, tokenizer, vocabularies: ~400k) move to the permanent
        # generation, as vLLM does after init: a full collection then walks only what came
        # after (one took ~100 ms here, holding the GIL, and so the step thread, that long).
        # ``shutdown`` unfreezes them (a process may make many engines).
        gc.collect()
        gc.freeze()
        self._loop.start()

    @property
    def _lock(self) -> threading.Lock:
        return self._loop.lock

    @property
    def dead(self) -> BaseException | None:
        """The exception that killed the loop thread (None while it lives)."""
        return self._loop.dead

    @property
    def tp_size(self) -> int:
        return self.config.tp_size

    # ---- submission ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt; a sequence of ids is returned as a list of ints (their
        range is checked by `submit`)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestValidationError(
                "prompt must be a str or a sequence of token ids", "prompt"
            ) from None

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @property
    def grammar_manager(self) -> GrammarManager:
        """The grammar manager, created on first use (see `EngineParts.grammar_manager`)."""
        return self.parts.grammar_manager

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        sink: Callable[[RequestOutput], None] | None = None,
        request_id: str | None = None,
        namespace: Hashable | None = None,
    ) -> str:
        """Queue one request (all `params.n` branches); outputs go to `sink` on the loop thread.

        The one validation point: everything that can reach the step loop (token ids, stop
        token ids, logit bias ids, prompt length, the constraint) is checked here, and a problem
        raises `RequestValidationError` (a `ValueError` naming the field) with nothing queued.
        Raises `EngineDeadError` when the engine is shut down or its thread died. Validating a
        constraint may take a while (schema checks, regex parsing): call off an event loop.
        """
        if self._loop.stopped.is_set() or self.dead is not None:
            raise EngineDeadError(self._dead_message())
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        self._validate(ids, params)
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=ids,
            params=params,
            sink=sink,
            namespace=namespace,
        )
        if params.constraint is not None:
            try:
                mgr = self.grammar_manager
                mgr.validate(params.constraint)
            except RecursionError:
                raise RequestValidationError(
                    "constraint: nested too deeply to check", "constraint"
                ) from None
            except ValueError as exc:  # GrammarError, or the backend is not installed
                raise RequestValidationError(str(exc), "constraint") from exc
            req.grammar_future = mgr.submit(params.constraint)
            req.grammar_future.add_done_callback(lambda _: self._loop.put("wake"))
        self.parts.appender.init_request(req)
        self._loop.put("add", req)
        return req.request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        vocab = self.runner.vocab_size
        if not ids:
            raise RequestValidationError("prompt must contain at least one token", "prompt")
        for name, values in (
            ("prompt", ids),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", [t for t, _ in params.logit_bias]),
        ):
            bad = [t for t in values if not 0 <= t < vocab]
            if bad:
                raise RequestValidationError(
                    f"{name}: token ids out of range [0, {vocab}): {bad[:5]}", name
                )
        if len(ids) >= self.max_model_len:
            raise RequestValidationError(
                f"prompt has {len(ids)} tokens; the maximum context length is "
                f"{self.max_model_len} (prompt + at least one generated token)",
                "prompt",
                code="context_length_exceeded",
            )

    @property
    def num_queued(self) -> int:
        """Requests submitted and not yet running (O(1), no lock: a momentary estimate)."""
        return self._loop.inbox.qsize() + len(self.scheduler.waiting)

    def abort(self, request_id: str) -> None:
        self._loop.put("abort", request_id)

    # ---- sync API -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> GenerateResult | list[GenerateResult]:
        """Generate for one prompt (str or token ids) or a batch; batches are submitted together."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)
        )
        batch = [prompts] if single else list(prompts)
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"got {len(plist)} sampling params for {len(batch)} prompts")
        waiters = []
        for prompt, p in zip(batch, plist):
            q: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
            rid = self.submit(prompt, p, sink=q.put)
            waiters.append((rid, q, (p or SamplingParams()).n))
        results = [self._collect(*w) for w in waiters]
        return results[0] if single else results

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield deltas as they are produced; closing the iterator early aborts the request."""
        q: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        n = (params or SamplingParams()).n
        rid = self.submit(prompt, params, sink=q.put)
        done = 0
        try:
            while done < n:
                out = q.get()
                done += out.finished
                yield out
        finally:
            if done < n:
                self.abort(rid)

    def _collect(self, rid: str, q: queue.SimpleQueue, n: int) -> GenerateResult:
        outs = [Completion(index=i) for i in range(n)]
        done, last = 0, None
        while done < n:
            out = q.get()
            outs[out.index].add(out)
            done += out.finished
            last = out
        return _result(rid, outs, last)

    # ---- async API ----------------------------------------------------------------------------

    async def generate_async(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> GenerateResult:
        n = (params or SamplingParams()).n
        outs = [Completion(index=i) for i in range(n)]
        last = None
        rid = None
        async for out in self.stream_async(prompt, params):
            rid = out.request_id
            outs[out.index].add(out)
            last = out
        return _result(rid or "", outs, last)

    async def stream_async(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Async deltas; cancellation (e.g. a client disconnect) aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        n = (params or SamplingParams()).n
        rid = self.submit(
            prompt,
            params,
            sink=lambda o: loop.call_soon_threadsafe(q.put_nowait, o),
            request_id=request_id,
        )
        done = 0
        try:
            while done < n:
                out = await q.get()
                done += out.finished
                yield out
        finally:
            if done < n:
                self.abort(rid)

    # ---- control ------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """The step thread is alive and the engine is not shut down."""
        return self._loop.alive

    def _dead_message(self) -> str:
        if self.dead is not None:
            return f"the engine died: {type(self.dead).__name__}: {self.dead}"
        return "engine is shut down"

    def stats(self) -> EngineStats:
        """O(1) reads of counters the engine keeps, without the engine lock: a scrape never
        waits for (or slows) a step. Fields are read one by one, so a snapshot taken during a
        step may mix before/after values."""
        s = self.scheduler
        g = self.parts.appender.grammar
        hit, queried = self.cache.hit_counters()
        tier = self.parts.hicache.stats() if self.parts.hicache is not None else None
        tier_fields = {} if tier is None else {
            "hicache_pages": tier.pages,
            "hicache_bytes": tier.used_bytes,
            "hicache_capacity_bytes": tier.capacity_bytes,
            "hicache_hit_tokens": tier.hit_tokens,
            "hicache_loaded_pages": tier.loaded_pages,
            "hicache_load_seconds": tier.load_seconds,
            "hicache_stored_pages": tier.stored_pages,
            "hicache_dropped_pages": tier.dropped_pages,
            "hicache_write_errors": tier.write_errors,
        }  # fmt: skip
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_pages_total=self.pool.num_pages,
            kv_pages_used=self.pool.num_held,
            kv_pages_cached=self.pool.num_cached,
            kv_pages_free=self.pool.num_free,
            page_size=self.pool.page_size,
            cache_hit_tokens=hit,
            cache_queried_tokens=queried,
            cache_hit_rate=hit / queried if queried else 0.0,
            prompt_tokens=s.total_prompt_tokens,
            computed_prompt_tokens=s.total_computed_prompt_tokens,
            generated_tokens=s.total_generated_tokens,
            num_retractions=s.num_retractions,
            num_forwards=s.num_forwards,
            num_jump_forward_tokens=g.num_jump_forward_tokens if g else 0,
            last_step_tokens=s.last_step.num_tokens,
            last_step_seconds=s.last_step.step_seconds,
            spec_drafts=s.num_drafts,
            spec_draft_tokens=s.num_draft_tokens,
            spec_accepted_tokens=s.num_accepted_draft_tokens,
            spec_decodes=s.num_spec_decodes,
            forward_tokens=s.total_forward_tokens,
            verifier_events=g.verifier_events() if g else {},
            **tier_fields,
        )

    def snapshot(self, options: SnapshotOptions | None = None) -> EngineSnapshot:
        """A live-view snapshot (see `radixlm.runtime.observe`): O(summary size) under the
        lock, never a walk over the whole tree; serialize it outside."""
        with self._lock:
            return take_snapshot(self.scheduler, options)

    def check_integrity(self) -> None:
        with self._lock:
            self.scheduler.check_integrity()

    def flush_cache(self) -> bool:
        """Drop every cached page, the second tier's too; only when no request is running or
        waiting."""
        with self._lock:
            if self.scheduler.has_work():
                return False
            self.cache.reset()
            if self.parts.hicache is not None:
                self.parts.hicache.clear()
            return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is running or waiting (and the inbox is drained)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._loop.inbox.empty() and not self.scheduler.has_work():
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def shutdown(self) -> None:
        if self._loop.stopped.is_set():
            return
        self._loop.stop()
        self._close_hicache()
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()
        if self.parts.grammar is not None:
            self.parts.grammar.shutdown()
        if self.scheduler.appender.grammar is not None:
            self.scheduler.appender.grammar.close()
        gc.unfreeze()  # what this engine leaves (and the startup froze) may be collected again

    def _close_hicache(self) -> None:
        """Write the tree's pages the tier lacks back to it (a restart finds them) and wait
        for the writes. The loop has stopped: nothing else touches the pool."""
        tier = self.parts.hicache
        if tier is None:
            return
        loads = self.scheduler.pages.tier_loads
        if loads is not None:
            loads.close()
        try:
            with self._lock:
                tier.write_back_all()
            tier.close()
        except Exception:  # noqa: BLE001 - shutting down: log, never raise
            logger.exception("hicache: write-back at shutdown failed")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _result(rid: str, outs: list[Completion], last: RequestOutput | None) -> GenerateResult:
    usage = Usage(
        prompt_tokens=last.prompt_tokens if last else 0,
        completion_tokens=sum(len(o.output_token_ids) for o in outs),
        cached_tokens=last.cached_tokens if last else 0,
    )
    return GenerateResult(request_id=rid, outputs=outs, usage=usage)
