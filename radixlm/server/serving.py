"""The bridge between the asyncio server and the engine thread, shared by every endpoint.

`EngineClient` turns validated API requests into `GenerationRequest`s (token ids, sampling
params, constraint) and submits them as a `RequestGroup` (`request_group.py`), which streams the
deltas of one HTTP request's prompts back onto the event loop. Nothing here blocks the loop:
tokenization runs in a worker thread, `Engine.submit` / `Engine.abort` only enqueue, and results
arrive through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response, StreamingResponse

from radixlm.runtime.engine import Engine
from radixlm.runtime.outputs import Completion
from radixlm.runtime.request import RequestOutput
from radixlm.runtime.sampling_params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from radixlm.server.errors import ApiError, OrjsonResponse
from radixlm.server.limits import check_prompt_chars
from radixlm.server.metrics import ServerMetrics
from radixlm.server.request_group import GenerationRequest, RequestGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side knobs (the engine's are in `radixlm.config.EngineConfig`)."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    max_n: int = 16  # most sequences (`n`) one request may ask for
    max_batch_prompts: int = 64  # most prompts in one batched request
    log_level: str = "info"
    dashboard_show_text: bool = False  # /dashboard shows prompt text, not only token-id hashes
    # ---- limits: each refusal is a 4xx naming the limit (and its flag)
    max_body_bytes: int = 8 * 2**20  # request body; 413 past it, enforced while reading
    max_prompt_chars: int | None = None  # before tokenizing; None: 16 x max_model_len
    max_stop_strings: int = 16
    max_stop_chars: int = 512  # length of one stop string
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_constraint_chars: int = 65536  # JSON schema text / regex / EBNF grammar
    max_schema_depth: int = 32  # JSON nesting of a schema (objects and arrays)
    max_schema_nodes: int = 4096  # JSON values in a schema
    max_logit_bias: int = 300  # entries of logit_bias (OpenAI's limit)
    # ---- overload and deadlines
    max_queued_requests: int = 1024  # prompts submitted but not yet running; 503 past it
    request_timeout_s: float | None = None  # default per-request deadline (`timeout` overrides)
    shutdown_timeout_s: float = 30.0  # SIGTERM: running requests get this long to finish

    def __post_init__(self) -> None:
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}], got {self.max_n}")
        if self.max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {self.max_batch_prompts}")
        if not 0 <= self.max_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        positive = (
            "max_body_bytes", "max_stop_strings", "max_stop_chars", "max_constraint_chars",
            "max_schema_depth", "max_schema_nodes", "max_queued_requests", "max_logit_bias",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")


def sampling_params(names: dict[str, str], **kwargs: Any) -> SamplingParams:
    """`SamplingParams(**kwargs)`; its ValueError becomes a 400 naming the API's field.

    `names` maps engine field names to API names (`max_new_tokens` -> `max_tokens`).
    """
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        msg = str(exc)
        field_name = msg.split(" ", 1)[0].rstrip(":")
        param = names.get(field_name, field_name)
        raise ApiError(msg.replace(field_name, param, 1), param=param) from exc


class EngineClient:
    """Everything the endpoints need from the engine, as loop-friendly calls."""

    def __init__(self, engine: Engine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.active: dict[str, RequestGroup] = {}
        self.draining = False  # set on SIGTERM: new requests get 503
        self.model_name = config.served_model_name or _model_name(engine)
        self._token_text: dict[int, str] = {}
        self._template_tools: bool | None = None

    # ---- preparation --------------------------------------------------------------------------

    @property
    def max_prompt_chars(self) -> int:
        return self.config.max_prompt_chars or 16 * self.engine.max_model_len

    async def tokenize(self, prompt: str | Sequence[int], param: str) -> list[int]:
        """Token ids (text is tokenized in a worker thread after the `--max-prompt-chars`
        check; ids are checked by `Engine.submit`)."""
        if not isinstance(prompt, str):
            return list(prompt)
        check_prompt_chars(prompt, self.max_prompt_chars, param)
        return await run_in_threadpool(self.engine.tokenize, prompt)

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        continue_final: bool,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of a chat request; `tools` (and earlier tool turns) are rendered by
        the model's template when it supports them, else as `radixlm.server.tools` documents."""
        from radixlm.server.tools import messages_for_template

        def render() -> str:
            native = self.template_renders_tools()
            kwargs = {"tools": tools} if tools and native else {}
            return self.engine.tokenizer.apply_chat_template(
                messages_for_template(messages, tools, native),
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
                **kwargs,
            )

        try:
            return await run_in_threadpool(render)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input
            raise ApiError(f"messages: cannot apply the chat template: {exc}", "messages") from exc

    def template_renders_tools(self) -> bool:
        """Whether the model's chat template renders a `tools=` argument (it changes the text)."""
        if self._template_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = {"type": "function", "function": {"name": "probe_tool", "parameters": {}}}
            tok = self.engine.tokenizer
            try:
                plain = tok.apply_chat_template(probe, tokenize=False)
                with_tools = tok.apply_chat_template(probe, tools=[tool], tokenize=False)
                self._template_tools = plain != with_tools
            except Exception:  # noqa: BLE001 - no template, or one that rejects tools
                self._template_tools = False
        return self._template_tools

    def check_n(self, n: int, param: str = "n") -> None:
        if n > self.config.max_n:
            raise ApiError(
                f"{param} must be <= {self.config.max_n} (this server's --max-n), got {n}", param
            )

    def check_length(
        self, ids: list[int], max_new_tokens: int, prompt_param: str, param: str
    ) -> None:
        """Prompt + completion within the context (the prompt alone is `Engine.submit`'s)."""
        limit = self.engine.max_model_len
        if 0 < len(ids) < limit and len(ids) + max_new_tokens > limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_new_tokens} tokens ({len(ids)} in the prompt, {max_new_tokens} "
                f"for the completion). Please reduce the prompt or {param}.",
                param=param,
                code="context_length_exceeded",
            )

    def new_request_id(self, prefix: str, rid: str | None) -> str:
        """A fresh id, or the client's (its uniqueness is checked when the group reserves it)."""
        return f"{prefix}{uuid.uuid4().hex}" if rid is None else rid

    def timeout(self, requested: float | None) -> float | None:
        return requested if requested is not None else self.config.request_timeout_s

    async def submit(
        self, reqs: Sequence[GenerationRequest], timeout_s: float | None = None
    ) -> RequestGroup:
        """Submit the prompts of one HTTP request: 503 with `Retry-After` when the waiting
        queue is full (`--max-queued-requests`) or the engine is down."""
        if self.draining:
            raise ApiError("the server is shutting down", status_code=503, code="shutting_down")
        if not self.engine.healthy:
            raise ApiError(self.engine._dead_message(), status_code=503, code="engine_unavailable")
        queued = self.engine.num_queued
        limit = self.config.max_queued_requests
        if queued + len(reqs) > limit:
            raise ApiError(
                f"server overloaded: {queued} requests are waiting (--max-queued-requests "
                f"{limit}); retry later",
                status_code=503,
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        group = RequestGroup(self, reqs, self.timeout(timeout_s))
        await group.start()
        return group

    async def run_bounded(self, call: Callable[[], str], request_id: str) -> str:
        """`call()` (an `Engine.submit` that validates a constraint) in a worker thread, for at
        most the engine's grammar timeout; past it, a 503 naming the limit, and the request is
        aborted if the late call queues it after all."""
        limit = self.engine.config.grammar_timeout_s
        fut = asyncio.get_running_loop().run_in_executor(None, call)
        done, _ = await asyncio.wait({fut}, timeout=limit)
        if not done:
            engine = self.engine

            def abort_late(f: asyncio.Future[str]) -> None:
                if not f.cancelled() and f.exception() is None:
                    engine.abort(request_id)

            fut.add_done_callback(abort_late)
            raise ApiError(
                f"checking the constraint took longer than {limit:g} s (--grammar-timeout-s); "
                "simplify it",
                status_code=503,
                code="grammar_timeout",
                headers={"Retry-After": "1"},
            )
        return fut.result()

    # ---- helpers for responses ----------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def abort(self, request_id: str) -> bool:
        group = self.active.get(request_id)
        self.engine.abort(request_id)
        return group is not None

    def fail_all_active(self, message: str, code: str) -> int:
        """Fail every request in flight with a 503 (`message`); returns how many."""
        groups = {id(g): g for g in self.active.values()}
        for group in groups.values():
            group.fail(ApiError(message, status_code=503, code=code, headers={"Retry-After": "1"}))
        return len(groups)

    def abort_all(self) -> int:
        rids = list(self.active)
        for rid in rids:
            self.engine.abort(rid)
        return len(rids)


def _model_name(engine: Engine) -> str:
    from radixlm.runtime.models.loader import DEFAULT_MODEL

    name = engine.config.model
    if name is None:
        return DEFAULT_MODEL
    return str(name).rstrip("/").rsplit("/", 1)[-1]


async def run_until_disconnect(request: Any, coro: Callable[[], Any]) -> Any:
    """Await `coro()`; if the client disconnects first, cancel it (its `finally` aborts)."""
    task = asyncio.ensure_future(coro())

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - we only need it stopped
            pass
        logger.info("client disconnected; request aborted")
        raise ClientDisconnected
    return task.result()


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def collect(group: RequestGroup) -> list[list[Completion]]:
    """Gather a group's deltas into one `Completion` per (prompt, branch)."""
    outs = [[Completion(index=i) for i in range(m.n)] for m in group.members]
    async for k, out in group:
        outs[k][out.index].add(out)
    return outs


def raise_if_failed(outs: list[list[Completion]]) -> None:
    """An engine-side failure of any sequence fails the HTTP request with a 500."""
    for per_prompt in outs:
        for c in per_prompt:
            if c.finish_reason == "error":
                raise engine_error(c.error, c.error_code)


# How a request's failure inside the engine reaches its client (`RequestOutput.error_code`).
_ERROR_STATUS = {
    "grammar_timeout": 503,  # the constraint did not compile in time (queue + compile)
    "grammar_error": 400,  # the constraint failed to compile
    "shutting_down": 503,  # aborted by a graceful stop
}


def engine_error(message: str | None, code: str | None) -> ApiError:
    status = _ERROR_STATUS.get(code or "", 500)
    headers = {"Retry-After": "1"} if status == 503 else None
    return ApiError(
        f"the engine failed this request: {message or 'unknown error'}",
        status_code=status,
        code=code or "engine_error",
        headers=headers,
    )


async def respond(
    request: Any,
    group: RequestGroup,
    stream: bool,
    build: Callable[[list[list[Completion]]], Any],
    chunks: Callable[[], AsyncIterator[bytes]],
) -> Response:
    """The response of a submitted group: SSE `chunks()` when streaming, else `build(outs)` of
    every (prompt, branch) `Completion` as JSON; either way the group is closed at the end and
    an engine failure is an error response (`engine_error`)."""
    if stream:
        return SSEResponse(chunks(), on_close=group.close)
    try:
        outs = await run_until_disconnect(request, lambda: collect(group))
    finally:
        group.close()
    raise_if_failed(outs)
    return OrjsonResponse(build(outs))


def engine_client(request: Any) -> EngineClient:
    """The `EngineClient` of the app serving `request`."""
    return request.app.state.client


def error_event(out: RequestOutput) -> bytes:
    """The SSE event that ends a stream whose request the engine failed."""
    logger.error("streamed request failed: %s", out.error)
    return sse(engine_error(out.error, out.error_code).body())


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the stream ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
