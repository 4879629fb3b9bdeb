"""The bridge between the asyncio server and the engine thread, shared by every endpoint.

`EngineClient` turns validated API requests into `GenerationRequest`s (token ids, sampling
params, constraint) and submits them; a `RequestGroup` streams the deltas of one HTTP request's
prompts back onto the event loop. Nothing here blocks the loop: tokenization runs in a worker
thread, `Engine.submit` / `Engine.abort` only enqueue, and results arrive through
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from radixlm.runtime.engine import Engine
from radixlm.runtime.grammar.base import GrammarError
from radixlm.runtime.outputs import Completion
from radixlm.runtime.request import RequestOutput
from radixlm.runtime.sampling_params import MAX_N, SamplingParams
from radixlm.server.constraints import RequestConstraint
from radixlm.server.errors import ApiError
from radixlm.server.metrics import ServerMetrics

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

    def __post_init__(self) -> None:
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}], got {self.max_n}")
        if self.max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {self.max_batch_prompts}")


@dataclass
class GenerationRequest:
    """One prompt, ready for `Engine.submit`."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    constraint: RequestConstraint | None = None  # also in `params`; kept for error messages


def sampling_params(names: dict[str, str], **kwargs: Any) -> SamplingParams:
    """`SamplingParams(**kwargs)`; its ValueError becomes a 400 naming the API's field.

    `names` maps engine field names to API names (`max_new_tokens` -> `max_tokens`).
    """
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        msg = str(exc)
        field_name = msg.split(" ", 1)[0]
        param = names.get(field_name, field_name)
        raise ApiError(msg.replace(field_name, param, 1), param=param) from exc


@dataclass
class _Member:
    """Bookkeeping for one submitted prompt (all its `n` branches)."""

    request_id: str
    n: int
    start: float
    remaining: set[int] = field(default_factory=set)
    first: dict[int, float] = field(default_factory=dict)
    last: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0


class RequestGroup:
    """The prompts of one HTTP request, submitted together; yields `(prompt_index, delta)`.

    Every branch gets exactly one finished delta: when the engine fails or aborts one branch of
    a prompt (possibly before its siblings were forked), the group finishes the missing ones with
    the same reason. `close()` aborts whatever is unfinished (a client disconnect) and is
    idempotent; call it in a `finally`.
    """

    def __init__(self, client: EngineClient, reqs: Sequence[GenerationRequest]) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, float, RequestOutput]] = asyncio.Queue()
        self.members: list[_Member] = []
        self.prompt_ids: list[list[int]] = [list(r.prompt_ids) for r in reqs]
        self._open = 0
        for k, req in enumerate(reqs):
            member = _Member(req.request_id, req.params.n, time.perf_counter())
            member.remaining = set(range(req.params.n))
            member.prompt_tokens = len(req.prompt_ids)
            try:
                client.engine.submit(
                    req.prompt_ids,
                    req.params,
                    sink=partial(self._sink, k),
                    request_id=req.request_id,
                )
            except ValueError as exc:
                self.close()
                rc = req.constraint
                if isinstance(exc, GrammarError) and rc is not None:
                    raise ApiError(f"{rc.param}: {exc}", param=rc.param) from exc
                raise ApiError(str(exc)) from exc
            self.members.append(member)
            client.active[req.request_id] = self
            self._open += 1

    def _sink(self, k: int, out: RequestOutput) -> None:
        """Engine thread: hand the delta to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (k, time.perf_counter(), out))
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    @property
    def done(self) -> bool:
        return self._open == 0

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._open:
            k, t, out = await self._queue.get()
            member = self.members[k]
            if out.index not in member.remaining:
                continue  # a sibling's abort delta after the group already finished it
            self._track(member, t, out)
            yield k, out
            if out.finished and out.finish_reason in ("error", "abort"):
                for i in sorted(member.remaining):
                    synthetic = _synthetic_finish(out, i)
                    self._track(member, t, synthetic)
                    yield k, synthetic

    def usage(self) -> dict[str, Any]:
        """OpenAI `usage`: prompt tokens count once per prompt, completions over all branches."""
        prompt = sum(m.prompt_tokens for m in self.members)
        completion = sum(sum(m.tokens.values()) for m in self.members)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m.cached_tokens for m in self.members)},
        }

    def _track(self, member: _Member, t: float, out: RequestOutput) -> None:
        i = out.index
        member.cached_tokens = max(member.cached_tokens, out.cached_tokens)
        if out.token_ids:
            member.first.setdefault(i, t)
            member.last[i] = t
            member.tokens[i] = member.tokens.get(i, 0) + len(out.token_ids)
        if out.finished:
            member.remaining.discard(i)
            self._client.metrics.observe_sequence(
                out.finish_reason or "unknown",
                ttft=member.first[i] - member.start if i in member.first else None,
                tokens=member.tokens.get(i, 0),
                decode_seconds=member.last.get(i, t) - member.first.get(i, t),
            )
            if not member.remaining:
                self._finish_member(member, t)

    def _finish_member(self, member: _Member, t: float) -> None:
        self._open -= 1
        self._client.active.pop(member.request_id, None)
        self._client.metrics.observe_request(t - member.start, member.cached_tokens)

    def close(self) -> None:
        """Abort every unfinished prompt (idempotent)."""
        now = time.perf_counter()
        for member in self.members:
            if member.remaining:
                self._client.engine.abort(member.request_id)
                for _ in member.remaining:
                    self._client.metrics.observe_sequence("abort", None, 0, 0.0)
                member.remaining.clear()
                self._finish_member(member, now)


def _synthetic_finish(out: RequestOutput, index: int) -> RequestOutput:
    return RequestOutput(
        request_id=out.request_id,
        index=index,
        text="",
        token_ids=[],
        logprobs=[],
        finished=True,
        finish_reason=out.finish_reason,
        error=out.error,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
    )


class EngineClient:
    """Everything the endpoints need from the engine, as loop-friendly calls."""

    def __init__(self, engine: Engine, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.active: dict[str, RequestGroup] = {}
        self.model_name = config.served_model_name or _model_name(engine)
        self._token_text: dict[int, str] = {}
        self._template_tools: bool | None = None

    # ---- preparation --------------------------------------------------------------------------

    async def tokenize(self, prompt: str | Sequence[int], param: str) -> list[int]:
        try:
            ids = await run_in_threadpool(self.engine.tokenize, prompt)
        except ValueError as exc:
            raise ApiError(f"{param}: {exc}", param=param) from exc
        if not ids:
            raise ApiError(f"{param}: the prompt must contain at least one token", param=param)
        return ids

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        continue_final: bool,
        tools: list[dict[str, Any]] | None = None,
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
                add_generation_prompt=not continue_final,
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
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{len(ids)} tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if len(ids) + max_new_tokens > limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_new_tokens} tokens ({len(ids)} in the prompt, {max_new_tokens} "
                f"for the completion). Please reduce the prompt or {param}.",
                param=param,
                code="context_length_exceeded",
            )

    def new_request_id(self, prefix: str, rid: str | None) -> str:
        if rid is None:
            return f"{prefix}{uuid.uuid4().hex}"
        if rid in self.active:
            raise ApiError(f"rid: request id {rid!r} is already in use", param="rid")
        return rid

    def submit(self, reqs: Sequence[GenerationRequest]) -> RequestGroup:
        return RequestGroup(self, reqs)

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
                raise ApiError(
                    f"the engine failed this request: {c.error or 'unknown error'}",
                    status_code=500,
                    code="engine_error",
                )


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
