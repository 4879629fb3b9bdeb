"""Request-level limits enforced before any endpoint runs, and the per-field limit checks the
endpoints share.

`BodyGuard` (pure ASGI) reads a request body at most `max_body_bytes` long: a `Content-Length`
past the limit is refused before a byte is read, and a chunked body is refused (413) as soon as
it crosses the limit, never buffered whole. A non-empty body must be JSON (`Content-Type:
application/json`) in valid UTF-8 (400 otherwise). The endpoints then see the buffered body.

Invariant: every refusal is an OpenAI-style error body naming the limit and the flag that sets
it, with a 4xx status; nothing here touches the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.schema_text import check_json_shape
from radixlm.server.errors import ApiError

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _is_json(content_type: bytes) -> bool:
    mime = content_type.split(b";", 1)[0].strip().lower()
    return mime == b"application/json" or (
        mime.startswith(b"application/") and mime.endswith(b"+json")
    )


class BodyGuard:
    """Body size (413), content type and UTF-8 (400) for every request with a body."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await self._refuse(scope, receive, send, ApiError("invalid Content-Length header"))
                return
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send, self._too_large(size))
                return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                await self._refuse(scope, receive, send, self._too_large(None))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            error = _check_body(body, headers.get(b"content-type", b""))
            if error is not None:
                await self._refuse(scope, receive, send, error)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # disconnect detection keeps working

        await self.app(scope, replay, send)

    def _too_large(self, size: int | None) -> ApiError:
        got = f" ({size} bytes)" if size is not None else ""
        return ApiError(
            f"request body too large{got}: the limit is {self.max_body_bytes} bytes "
            "(--max-body-bytes)",
            status_code=413,
            code="request_too_large",
        )

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        response = error.response()
        if error.status_code == 413:
            response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)


def _check_body(body: bytes, content_type: bytes) -> ApiError | None:
    if not _is_json(content_type):
        shown = content_type.decode("latin-1") or "none"
        return ApiError(
            f"Content-Type must be application/json, got {shown}", code="invalid_content_type"
        )
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return ApiError(
            f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding"
        )
    return None


# ---- per-field limits (the endpoints call these with the server's config) ----------------------


def check_prompt_chars(prompt: str | Sequence[Any], limit: int, param: str) -> None:
    """Before tokenizing: a text prompt (or chat messages, summed) of more than `limit` chars."""
    if isinstance(prompt, str) and len(prompt) > limit:
        raise ApiError(
            f"{param}: {len(prompt)} characters; the limit is {limit} (--max-prompt-chars)",
            param=param,
            code="prompt_too_long",
        )


def check_stop(
    stop: str | Sequence[str] | None, max_count: int, max_chars: int, param: str
) -> None:
    if stop is None:
        return
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > max_count:
        raise ApiError(
            f"{param}: {len(items)} stop strings; the limit is {max_count} (--max-stop-strings)",
            param=param,
        )
    longest = max((len(s) for s in items), default=0)
    if longest > max_chars:
        raise ApiError(
            f"{param}: a stop string of {longest} characters; the limit is {max_chars} "
            "(--max-stop-chars)",
            param=param,
        )


def check_top_logprobs(value: int, limit: int, param: str) -> None:
    if value > limit:
        raise ApiError(
            f"{param}: {value} top logprobs; the limit is {limit} (--max-top-logprobs)",
            param=param,
        )


def check_constraint_size(
    spec: Any, param: str, max_chars: int, max_depth: int, max_nodes: int
) -> None:
    """A schema (parsed JSON or text), regex or grammar within the server's size limits. The
    depth check is iterative: a 10,000-deep schema is a 400, not a RecursionError."""
    text_len = len(spec) if isinstance(spec, str) else None
    if text_len is not None and text_len > max_chars:
        raise ApiError(
            f"{param}: {text_len} characters; the limit is {max_chars} (--max-constraint-chars)",
            param=param,
        )
    if isinstance(spec, (dict, list)):
        try:
            check_json_shape(spec, param, max_depth, max_nodes)
        except GrammarError as exc:
            flag = "--max-schema-depth" if "levels" in str(exc) else "--max-schema-nodes"
            raise ApiError(f"{exc} ({flag})", param=param) from None


def check_logit_bias(bias: dict[str, float] | None, limit: int, param: str) -> dict[int, float]:
    """OpenAI's `logit_bias`: token id (as a string key) -> bias in [-100, 100]. Ids are checked
    against the vocabulary by `Engine.submit`."""
    if not bias:
        return {}
    if len(bias) > limit:
        raise ApiError(
            f"{param}: {len(bias)} entries; the limit is {limit} (--max-logit-bias)", param=param
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(f"{param}: key {key!r} is not a token id", param=param) from None
        if not -100.0 <= value <= 100.0:
            raise ApiError(
                f"{param}: bias {value} for token {key} is outside [-100, 100]", param=param
            )
        out[token] = float(value)
    return out
