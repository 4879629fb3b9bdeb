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
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from radixlm.config import EngineConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.cpu_threads import pin_forward_threads, release_idle_teams
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.errors import EngineDeadError, RequestValidationError
from radixlm.runtime.executor import Executor
from radixlm.runtime.model_runner import ModelRunner, pick_device
from radixlm.runtime.observe import EngineSnapshot, SnapshotOptions, take_snapshot
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.outputs import Completion, EngineStats, GenerateResult, Usage
from radixlm.runtime.request import Request, RequestOutput
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduler

if TYPE_CHECKING:
    from radixlm.runtime.grammar import GrammarManager

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class Engine:
    """`Engine(model=None, dtype="bfloat16", **config)`; see `EngineConfig` for the knobs."""

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", **kwargs: Any) -> None:
        from radixlm.runtime.models.loader import load_tokenizer, resolve_model_path
        from radixlm.runtime.models.model_info import load_model_info

        self.config = EngineConfig.from_kwargs(model=model, dtype=dtype, **kwargs)
        cfg = self.config
        from radixlm.runtime.grammar import backend_names

        if cfg.grammar_backend not in backend_names():
            raise ValueError(
                f"grammar_backend must be one of {backend_names()}, got {cfg.grammar_backend!r}"
            )
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # NOTE: intra-op thread settings are per OS thread: the loop thread copies ours.
        self._num_threads = torch.get_num_threads()
        self.model_dir = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model_info = load_model_info(self.model_dir)
        self.device = pick_device(cfg.device)
        self.runner = self._make_runner()
        if self.device.type == "cpu":
            release_idle_teams()  # the loading thread's team; the loop thread makes its own
        self.max_model_len = self.runner.max_model_len
        self.pool = BlockPool(self.runner.num_pages, cfg.cache.page_size)
        self.cache = RadixCache(self.pool, enabled=cfg.cache.enable_prefix_caching)
        eos = set(self.model_info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.processor = OutputProcessor(
            self.tokenizer,
            self.eos_token_ids,
            self.runner.vocab_size,
            self.max_model_len,
            self.device,
        )
        self.executor = Executor(self.runner, self.eos_token_ids, seed=cfg.seed)
        self.scheduler = Scheduler(
            self.pool,
            self.cache,
            cfg.scheduler,
            self.processor,
            self.max_model_len,
            debug_integrity=cfg.debug_integrity,
        )
        self.core = EngineCore(self.scheduler, self.executor, self.processor)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._grammar: GrammarManager | None = None
        self._grammar_lock = threading.Lock()
        self._stopped = threading.Event()
        # The exception that killed the step thread (None while it lives): `submit` refuses,
        # `healthy` is False, and the server's /health fails and the process exits non-zero.
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="radixlm-engine", daemon=True)
        self._thread.start()

    def _make_runner(self) -> Any:
        """A `ModelRunner`, or with `tp_size > 1` rank 0's `TensorParallelRunner` (which
        starts the other ranks and runs every forward on all of them)."""
        cfg = self.config
        args = (self.model_dir, cfg.dtype, self.device, cfg.cache, cfg.attention_backend)
        from radixlm.runtime.models.model_info import context_length

        max_len = context_length(self.model_info, cfg.scheduler.max_model_len)
        if cfg.tp_size == 1:
            return ModelRunner(
                *args,
                max_len,
                model_info=self.model_info,
                matmul_dtype=cfg.matmul_dtype,
                enforce_eager=cfg.enforce_eager,
                quantization=cfg.quantization,
                quantization_group_size=cfg.quantization_group_size,
            )
        from radixlm.runtime.distributed.parallel_state import DistributedConfig
        from radixlm.runtime.distributed.tp_runner import TensorParallelRunner

        dist = DistributedConfig.from_env(
            cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr
        )
        if cfg.node_rank != 0:
            raise ValueError("node_rank > 0 runs tensor-parallel workers only (`radixlm serve`)")
        return TensorParallelRunner(
            *args,
            max_len,
            dist,
            num_threads=cfg.num_threads,
            quantization=cfg.quantization,
            quantization_group_size=cfg.quantization_group_size,
        )

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
        """The grammar manager (compile pool + cache), created on first use: importing a
        grammar backend costs seconds that unconstrained use should not pay. Raises
        `ValueError` when the configured backend is not installed."""
        with self._grammar_lock:
            if self._grammar is None:
                from radixlm.runtime.constrained import GrammarStep
                from radixlm.runtime.grammar import GrammarManager

                cfg = self.config
                try:
                    mgr = GrammarManager(
                        self.tokenizer,
                        self.runner.vocab_size,
                        self.eos_token_ids,
                        backend=cfg.grammar_backend,
                        timeout_s=cfg.grammar_timeout_s,
                        jump_forward_enabled=cfg.enable_jump_forward,
                    )
                except ImportError as exc:
                    raise ValueError(
                        f"grammar backend {cfg.grammar_backend!r} is not installed "
                        f"(pip install 'radixlm[grammar]'): {exc}"
                    ) from None
                step = GrammarStep(mgr, self.device)
                self.processor.set_grammar(step)
                self.executor.set_grammar(step)
                self._grammar = mgr
            return self._grammar

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
        if self._stopped.is_set() or self.dead is not None:
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
            req.grammar_future.add_done_callback(lambda _: self._inbox.put(("wake", None)))
        self.processor.init_request(req)
        self._inbox.put(("add", req))
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
        return self._inbox.qsize() + len(self.scheduler.waiting)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

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
        return self.dead is None and not self._stopped.is_set() and self._thread.is_alive()

    def _dead_message(self) -> str:
        if self.dead is not None:
            return f"the engine died: {type(self.dead).__name__}: {self.dead}"
        return "engine is shut down"

    def stats(self) -> EngineStats:
        """O(1) reads of counters the engine keeps, without the engine lock: a scrape never
        waits for (or slows) a step. Fields are read one by one, so a snapshot taken during a
        step may mix before/after values."""
        s = self.scheduler
        g = self.processor.grammar
        hit, queried = self.cache.hit_counters()
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
        """Drop every cached page; only when no request is running or waiting."""
        with self._lock:
            if self.scheduler.has_work():
                return False
            self.cache.reset()
            return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is running or waiting (and the inbox is drained)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._inbox.empty() and not self.scheduler.has_work():
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)
        if hasattr(self.runner, "shutdown"):
            self.runner.shutdown()
        if self._grammar is not None:
            self._grammar.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- loop thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        if self.device.type == "cpu":
            cpus = pin_forward_threads(self._num_threads)
            logger.info("forward on %d threads, pinned to CPUs %s", self._num_threads, cpus)
        else:
            torch.set_num_threads(self._num_threads)
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - recorded; the server exits non-zero
            self.dead = exc
            logger.critical("the engine thread died", exc_info=exc)
            self._fail_everything(f"the engine died: {type(exc).__name__}: {exc}")

    def _fail_everything(self, message: str) -> None:
        """Best effort after the thread died: tell every queued and running request."""
        try:
            while True:
                kind, arg = self._inbox.get_nowait()
                if kind == "add":
                    self.processor.fail(arg, message)
        except queue.Empty:
            pass
        except Exception:  # noqa: BLE001
            logger.exception("could not fail the queued requests")
        try:
            self.scheduler.fail_all(message)
            self.processor.drain()
        except Exception:  # noqa: BLE001
            logger.exception("could not fail the running requests")

    def _run(self) -> None:
        while not self._stopped.is_set():
            # NOTE: requests waiting only for a grammar compile do not spin the loop; the
            # compile's completion puts a "wake" command in the inbox.
            block = not self.scheduler.has_ready_work()
            try:
                cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                cmd = None
            with self._lock:
                while cmd is not None:
                    self._apply(cmd)
                    try:
                        cmd = self._inbox.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self.scheduler.has_ready_work() and not self._stopped.is_set():
                    self._step()
        with self._lock:
            for req in [*self.scheduler.running, *self.scheduler.waiting]:
                self.scheduler.abort(req.request_id)
            self.processor.drain()

    def _apply(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            self.scheduler.add_request(arg)
            self.processor.drain()
        elif kind == "abort":
            self.scheduler.abort(arg)
            self.processor.drain()

    def _step(self) -> None:
        try:
            self.core.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            # NOTE: the core fails a failed batch's own requests and the scheduler a request
            # that fails its own admission or page growth; what reaches here belongs to no one
            # request: nothing to attribute it to.
            logger.exception("scheduling failed; failing every request")
            self.scheduler.fail_all(f"internal error: {type(exc).__name__}: {exc}")
            self.processor.drain()


def _result(rid: str, outs: list[Completion], last: RequestOutput | None) -> GenerateResult:
    usage = Usage(
        prompt_tokens=last.prompt_tokens if last else 0,
        completion_tokens=sum(len(o.output_token_ids) for o in outs),
        cached_tokens=last.cached_tokens if last else 0,
    )
    return GenerateResult(request_id=rid, outputs=outs, usage=usage)
