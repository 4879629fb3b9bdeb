"""`EngineClient`: the one object the endpoints hold. It turns validated API requests into
`GenerationRequest`s (token ids, sampling params, constraint) and submits them as a
`RequestGroup` (`request_group.py`), which streams the deltas of one HTTP request's prompts back
onto the event loop. Nothing here blocks the loop: tokenization runs in a worker thread,
`Engine.submit` / `Engine.abort` only enqueue, and results arrive through
`loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool

from radixlm.runtime.engine import Engine
from radixlm.runtime.models.loader import DEFAULT_MODEL
from radixlm.server.errors import ApiError
from radixlm.server.limits import check_prompt_chars
from radixlm.server.metrics import ServerMetrics
from radixlm.server.request_group import GenerationRequest, RequestGroup
from radixlm.server.server_config import ServerConfig
from radixlm.server.tools import messages_for_template


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
    name = engine.config.model
    if name is None:
        return DEFAULT_MODEL
    return str(name).rstrip("/").rsplit("/", 1)[-1]
