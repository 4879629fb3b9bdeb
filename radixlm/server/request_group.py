"""One HTTP request's prompts in flight: `GenerationRequest` (a prompt ready for
`Engine.submit`) and `RequestGroup` (submits them together and streams their deltas back onto
the event loop, with per-branch bookkeeping for usage, metrics and the deadline)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from radixlm.runtime.errors import EngineDeadError, RequestValidationError
from radixlm.runtime.request import RequestOutput
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.constraints import RequestConstraint
from radixlm.server.errors import ApiError
from radixlm.server.metrics import ServerMetrics


class GroupHost(Protocol):
    """What a group needs from the client that submits it (`EngineClient`): the engine, the
    table of active requests, the metrics, and the bounded call into `Engine.submit`."""

    engine: Any
    active: dict[str, RequestGroup]
    metrics: ServerMetrics

    async def run_bounded(self, call: Callable[[], str], request_id: str) -> str: ...


@dataclass
class GenerationRequest:
    """One prompt, ready for `Engine.submit`. `names` maps the engine's field names in
    `RequestValidationError.field` (`prompt`, `stop_token_ids`, `logit_bias`) to the API's."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    constraint: RequestConstraint | None = None  # also in `params`; kept for error messages
    names: dict[str, str] = field(default_factory=dict)

    def api_error(self, exc: RequestValidationError) -> ApiError:
        """The 400 for an engine validation error, naming the API's field."""
        if exc.field == "constraint" and self.constraint is not None:
            param = self.constraint.param
        else:
            param = self.names.get(exc.field, exc.field)
        message = exc.message
        if message.startswith(f"{exc.field}: "):
            message = message[len(exc.field) + 2 :]
        return ApiError(f"{param}: {message}", param=param, code=exc.code)


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

    def __init__(
        self,
        client: GroupHost,
        reqs: Sequence[GenerationRequest],
        timeout_s: float | None = None,
    ) -> None:
        self._client = client
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, float, RequestOutput]] = asyncio.Queue()
        self.reqs = list(reqs)
        self.members: list[_Member] = []
        self.prompt_ids: list[list[int]] = [list(r.prompt_ids) for r in reqs]
        self._open = 0
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._failure: ApiError | None = None
        rids = [r.request_id for r in reqs]
        taken = [rid for rid in rids if rid in client.active]
        if taken or len(set(rids)) != len(rids):
            rid = taken[0] if taken else next(r for r in rids if rids.count(r) > 1)
            raise ApiError(f"rid: request id {rid!r} is already in use", param="rid")
        # NOTE: ids are reserved before the first await: a concurrent request cannot take them.
        for req in reqs:
            member = _Member(req.request_id, req.params.n, time.perf_counter())
            member.remaining = set(range(req.params.n))
            member.prompt_tokens = len(req.prompt_ids)
            self.members.append(member)
            client.active[req.request_id] = self
            self._open += 1

    async def start(self) -> None:
        """Submit every prompt (validation with a constraint runs off the event loop, bounded by
        the engine's grammar timeout). On any refusal, abort what was submitted and raise the
        `ApiError`."""
        try:
            for k, req in enumerate(self.reqs):
                await self._submit(k, req)
        except BaseException:
            self.close()
            raise

    async def _submit(self, k: int, req: GenerationRequest) -> None:
        engine = self._client.engine
        call = partial(
            engine.submit,
            req.prompt_ids,
            req.params,
            sink=partial(self._sink, k),
            request_id=req.request_id,
        )
        try:
            if req.params.constraint is None:
                call()
            else:
                await self._client.run_bounded(call, req.request_id)
        except RequestValidationError as exc:
            raise req.api_error(exc) from exc
        except EngineDeadError as exc:
            raise ApiError(str(exc), status_code=503, code="engine_unavailable") from exc

    def fail(self, error: ApiError) -> None:
        """End the group from the server side (shutdown, dead engine): abort what is
        unfinished and make the consumer raise `error`."""
        if self._failure is None and not self.done:
            self._failure = error
            self.close()
            self._queue.put_nowait((-1, time.perf_counter(), None))  # type: ignore[arg-type]

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
        """Deltas until every branch finished; past the deadline, abort everything unfinished
        (its pages are freed) and raise `ApiError` 408 naming `timeout`."""
        while self._open or self._failure is not None:
            if self.deadline is None:
                k, t, out = await self._queue.get()
            else:
                try:
                    k, t, out = await asyncio.wait_for(
                        self._queue.get(), max(self.deadline - time.monotonic(), 0.0)
                    )
                except asyncio.TimeoutError:
                    self.close()
                    raise ApiError(
                        f"timeout: the request did not finish within its deadline of "
                        f"{self.timeout_s:g} s and was aborted",
                        param="timeout",
                        status_code=408,
                        code="request_timeout",
                    ) from None
            if k < 0:
                assert self._failure is not None
                raise self._failure
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
        error_code=out.error_code,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
    )
