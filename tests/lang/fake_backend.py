"""A scripted backend for interpreter tests: no model, records every call."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import GenParams

Reply = Callable[[str, GenParams], str]


def token_logprob(token: int) -> float:
    """The fake model's logprob of a token (a char code here): depends on the token only."""
    return -((token * 7) % 10) / 10.0 - 0.05


class FakeBackend(BaseBackend):
    """`generate` answers `reply(prompt, params)`; tokens are characters; scores are
    `token_logprob` of each character (None at position 0)."""

    def __init__(
        self,
        reply: Reply | None = None,
        stream_delay: float = 0.0,
        resume: threading.Event | None = None,
    ) -> None:
        self.reply = reply or (lambda prompt, params: "ok")
        self.stream_delay = stream_delay
        # When given, a stream pauses after its first piece until `resume` is set (a reader
        # then sees at least two chunks, however slow the machine).
        self.resume = resume
        self.calls: list[tuple[str, Any, Any]] = []  # (kind, prompt(s), params / starts)
        self.lock = threading.Lock()

    def _record(self, kind: str, prompt: Any, extra: Any) -> None:
        with self.lock:
            self.calls.append((kind, prompt, extra))

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]

    def generate(self, prompt: str, params: GenParams) -> tuple[str | list[str], dict]:
        self._record("gen", prompt, params)
        meta = {"prompt_tokens": len(prompt), "cached_tokens": 0}
        if params.n and params.n > 1:
            return [self.reply(prompt, params) + str(i) for i in range(params.n)], meta
        return self.reply(prompt, params), meta

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, dict]]:
        self._record("stream", prompt, params)
        text = self.reply(prompt, params)
        for i in range(0, len(text), 2):
            if i and self.resume is not None:
                self.resume.wait(timeout=30)
            time.sleep(self.stream_delay)
            yield text[i : i + 2], {"completion_tokens": i // 2 + 1}

    def cache_prefix(self, prompt: str | Sequence[int]) -> None:
        self._record("cache", prompt, None)

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def score(self, prompts: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[Any]]:
        self._record("score", [list(p) for p in prompts], list(starts))
        return [
            [None if i == 0 else token_logprob(p[i]) for i in range(s, len(p))]
            for p, s in zip(prompts, starts)
        ]

    def get_chat_template(self) -> ChatTemplate:
        return ChatTemplate(None)  # ChatML

    def stats(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}
