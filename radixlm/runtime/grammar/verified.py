"""A compiled grammar with its verifier: the backend's matcher plus the exact checks.

``VerifiedMatcher`` wraps a backend matcher whose grammar is the context-free relaxation
(``relax``) and follows the same tokens with ``json_track`` + ``verifier.SchemaVerifier``.

Invariants (beside the ``GrammarMatcher`` ones, which hold for the relaxation):

- ``check_token(t)`` names the keyword that refuses ``t`` (the grammar allows it, the exact
  schema does not), else None; it changes nothing. The sampling step masks refused tokens
  and resamples (``constrained.GrammarStep.verify``).
- ``accept_token(t)`` refuses what ``check_token`` refuses, so the accepted tokens always spell
  a prefix of the relaxation whose completed values the exact schema admits; EOS is refused
  while the exact check of the end (a top-level number) fails, and ``is_completed`` says so.
- One scanner state per accepted token: ``rollback`` and ``fork`` stay exact and cheap.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.runtime.grammar.base import CompiledGrammar, GrammarMatcher
from radixlm.runtime.grammar.json_track import ScanState, advance_bytes, finish
from radixlm.runtime.grammar.strict import verifier_schema_text
from radixlm.runtime.grammar.verifier import SchemaVerifier


class VerifiedMatcher(GrammarMatcher):
    def __init__(
        self, inner: GrammarMatcher, verifier: SchemaVerifier, states: Sequence[ScanState] = ()
    ) -> None:
        super().__init__(inner.vocab)
        self.inner = inner
        self.verifier = verifier
        self._states: list[ScanState] = list(states) or [ScanState()]
        self._eos = frozenset(inner.vocab.eos_token_ids)
        self._tried: tuple[int, int, ScanState | str] | None = None  # (depth, token, result)

    def _next(self, token_id: int) -> ScanState | str:
        """The scanner state after ``token_id`` (EOS: the end), or the refusing keyword."""
        depth = len(self._states)
        if self._tried is not None and self._tried[:2] == (depth, token_id):
            return self._tried[2]
        state = self._states[-1]
        v = self.verifier
        if token_id in self._eos:
            result = finish(state, v, v.root)
        else:
            data = self.vocab.token_bytes[token_id]
            result = advance_bytes(state, data, v, v.root) if data else state
        self._tried = (depth, token_id, result)
        return result

    def check_token(self, token_id: int) -> str | None:
        result = self._next(token_id)
        return result if isinstance(result, str) else None

    def accept_token(self, token_id: int) -> bool:
        result = self._next(token_id)
        if isinstance(result, str) or not self.inner.accept_token(token_id):
            return False
        self._states.append(result)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_completed(self) -> bool:
        if self.inner.is_terminated():
            return True
        return self.inner.is_completed() and not isinstance(
            finish(self._states[-1], self.verifier, self.verifier.root), str
        )

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self._states[len(self._states) - num_tokens :]

    def fork(self) -> VerifiedMatcher:
        return VerifiedMatcher(self.inner.fork(), self.verifier, self._states)

    def forced_bytes(self) -> bytes:
        return self.inner.forced_bytes()

    @property
    def num_accepted(self) -> int:
        return self.inner.num_accepted


class VerifiedGrammar(CompiledGrammar):
    """``inner`` (a backend's compile of the relaxation) with ``verifier`` beside it."""

    def __init__(self, inner: CompiledGrammar, verifier: SchemaVerifier) -> None:
        super().__init__(inner.constraint, inner.backend, inner.vocab, inner.compile_time_s)
        self.inner = inner
        self.verifier = verifier

    def _make_matcher(self) -> VerifiedMatcher:
        return VerifiedMatcher(self.inner.new_matcher(), self.verifier)


def with_verifier(compiled: CompiledGrammar) -> CompiledGrammar:
    """``compiled`` with the verifier its schema needs (``strict.verifier_schema_text``), or
    as it is when the grammar alone enforces it. Every backend's ``compile`` ends here."""
    c = compiled.constraint
    if isinstance(compiled, VerifiedGrammar) or c.kind != "json_schema":
        return compiled
    text = verifier_schema_text(c.spec)
    if text is None:
        return compiled
    return VerifiedGrammar(compiled, SchemaVerifier.from_text(text))
