"""What every endpoint shares around the `EngineClient` (client.py): the one sampling-params
mapping, gathering a group's deltas, engine errors as HTTP errors, SSE framing, and cancelling
on a client disconnect."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from radixlm.runtime.outputs import Completion
from radixlm.runtime.request import RequestOutput
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.client import EngineClient
from radixlm.server.errors import ApiError, OrjsonResponse
from radixlm.server.request_group import RequestGroup

logger = logging.getLogger(__name__)


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
