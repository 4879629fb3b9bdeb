"""A compiled grammar with its verifier: the backend's matcher plus the exact checks.

``VerifiedMatcher`` wraps a backend matcher whose grammar is the context-free relaxation
(``relax``) and follows the same tokens with a tracker (``trackers``: ``JsonTracker`` for a
``json_schema`` constraint, ``ToolCallsTracker`` for each verified call's arguments).

Invariants (beside the ``GrammarMatcher`` ones, which hold for the relaxation):

- ``check_token(t)`` names the keyword that refuses ``t`` (the grammar allows it, the exact
  schema does not), else None; it changes nothing a caller can see (the backend's matcher
  keeps ``t`` accepted until the next call: ``accept_token(t)`` adopts it, with the forced
  bytes after it, and anything else takes it back first). The sampling step masks refused tokens
  and resamples (``constrained.GrammarStep.verify``). It looks one step ahead: ``t`` is also
  refused when the text the grammar forces after it (``forced_bytes``, what jump-forward
  appends), or the end where only EOS may follow, completes a value the exact schema refuses:
  every continuation of ``t`` would be refused, so taking it would be a dead end (e.g. ``0``
  where ``}`` is forced and ``not: {const: 0}``; ``"x`` of an enum, its quote forced).
- ``accept_token(t)`` refuses what the tracker refuses in ``t``'s own bytes (a subset of
  ``check_token``'s refusals), so the accepted tokens always spell a prefix of the relaxation
  whose completed values the exact schema admits; EOS is refused while the exact check of the
  end (a top-level number) fails, and ``is_completed`` says so.
- One scanner state per accepted token: ``rollback`` and ``fork`` stay exact and cheap. A run
  of tokens accepted together (``accept_tokens``: jump-forward's forced text) is fed to the
  tracker at once, its last state known and the ones inside it ``_LAZY`` until something reads
  them (``_state``: fed token by token from the last known one; feeding the same bytes in
  pieces refuses nothing that feeding them at once admits). The last state is never lazy. When
  ``check_token(t)`` fed the forced text after ``t`` (``_ahead``), accepting ``t`` and then
  that text reuses the state it found.
- ``num_settled()``: the accepted tokens before the outermost open value the exact schema may
  refuse by its own keywords (``json_track.open_checked``); the tokens after it are the ones a
  dead end may take back, so the scheduler holds them back from the client. It never
  decreases as tokens are accepted, so a held token is never one released before.
- A dead end (no token left) is left by ``backtrack``: the last accepted token is rolled back
  and banned at its position (``check_token`` / ``accept_token`` refuse it there, naming the
  keyword of the dead end), within a budget of rollbacks per matcher. Bans live at a position
  of this output prefix: rolling back past a position forgets its bans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixlm.runtime.grammar.base import CompiledGrammar, GrammarMatcher, get_backend
from radixlm.runtime.grammar.trackers import Tracker, tracker_for

_LAZY = object()  # a tracker state not computed yet (inside a run ``accept_tokens`` took)


class VerifiedMatcher(GrammarMatcher):
    can_backtrack = True

    def __init__(self, inner: GrammarMatcher, tracker: Tracker) -> None:
        super().__init__(inner.vocab)
        self.inner = inner
        self.tracker = tracker
        self._states: list[Any] = [tracker.start()]  # _states[k]: after _tokens[:k]
        self._tokens: list[int] = []
        # position -> {banned token: the keyword of the dead end it led to}
        self._bans: dict[int, dict[int, str]] = {}
        self.num_rollbacks = 0  # dead ends left by ``backtrack``
        self._eos = frozenset(inner.vocab.eos_token_ids)
        self._tried: tuple[int, int, Any] | None = None  # (depth, token, result)
        # (state, bytes, the state after them): what ``_ahead`` fed last, for accept_tokens (a
        # state is immutable and ``feed`` a function of it and the bytes: never stale)
        self._fed: list[tuple[Any, bytes, Any]] = []
        # A token ``_ahead`` left accepted by ``inner`` past ``_tokens`` (at depth
        # len(_tokens)), with the forced bytes after it: ``accept_token`` of that token adopts
        # it; anything else that reads or changes ``inner`` first rolls it back (``_release``).
        self._held: int | None = None
        self._held_forced = b""
        self._forced_now: bytes | None = None  # forced_bytes() of this state, once known
        # (open_from's offset, num_settled there): appending tokens leaves it true while the
        # offset is the same; a rollback forgets it
        self._settled: tuple[int, int] | None = None

    def _next(self, token_id: int) -> Any:
        """The tracker's state after ``token_id`` (EOS: the end), or the refusing keyword."""
        banned = self._bans.get(len(self._tokens))
        if banned and token_id in banned:
            return banned[token_id]
        depth = len(self._states)
        if self._tried is not None and self._tried[:2] == (depth, token_id):
            return self._tried[2]
        state = self._states[-1]
        if token_id in self._eos:
            result = self.tracker.end(state)
        else:
            data = self.vocab.token_bytes[token_id]
            if not data:
                result = state
            else:
                # jump-forward's one forced token: ``_ahead`` fed its text from this state
                fed = self._fed_state(state, data)
                result = fed if fed is not None else self.tracker.feed(state, data)
        self._tried = (depth, token_id, result)
        return result

    def check_token(self, token_id: int) -> str | None:
        if self.inner.loose_masks:  # the row's mask may hold tokens the grammar refuses
            self._release()
            keyword = self.inner.check_token(token_id)
            if keyword is not None:
                return keyword
        result = self._next(token_id)
        if isinstance(result, str):
            return result
        if token_id in self._eos:
            return None
        return self._ahead(token_id, result)

    def _ahead(self, token_id: int, state: Any) -> str | None:
        """The keyword refusing what the grammar forces after ``token_id`` (the tracker at
        ``state`` after it), or None. The inner matcher is left with ``token_id`` accepted
        (``_held``) when the grammar allows it."""
        inner = self.inner
        self._release()
        if not inner.accept_token(token_id):
            return None  # not allowed by the grammar: the mask handles it
        # ``inner`` stays one token ahead: the step accepts a token that passes right after
        # its check, and then reuses this acceptance and these forced bytes.
        self._held = token_id
        forced = self._held_forced = inner.forced_bytes()
        if forced:
            if self.tracker.inert(state, forced):
                return None
            after = self.tracker.feed(state, forced)
            if isinstance(after, str):
                return after
            # jump-forward appends ``forced`` after ``token_id`` (or re-spells both)
            data = self.vocab.token_bytes[token_id] or b""
            self._fed = [(state, forced, after), (self._states[-1], data + forced, after)]
            return None
        if inner.is_completed():
            end = self.tracker.end(state)
            if isinstance(end, str) and inner.only_eos_allowed():
                return end
        return None

    def _fed_state(self, state: Any, data: bytes) -> Any:
        """The state after ``data`` from ``state`` if ``_ahead`` fed exactly that, else None."""
        for s, d, a in self._fed:  # at most two entries: a loop, not a generator (per token)
            if s is state and d == data:
                return a
        return None

    def _release(self) -> None:
        """Roll ``inner`` back to ``_tokens`` if ``_ahead`` left a token accepted."""
        if self._held is not None:
            self._held = None
            self.inner.rollback(1)

    def accept_token(self, token_id: int) -> bool:
        result = self._next(token_id)
        if isinstance(result, str):
            return False
        forced = None
        if self._held is not None and self._held == token_id:
            self._held, forced = None, self._held_forced
        else:
            self._release()
            if not self.inner.accept_token(token_id):
                return False
        self._states.append(result)
        self._tokens.append(token_id)
        self._forced_now = forced
        return True

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """All or none; a run of several is fed to the tracker at once (the states inside it
        stay ``_LAZY``), or not at all when ``_ahead`` fed these bytes from this state."""
        n = len(self._tokens)
        data = self.vocab.join(token_ids) if len(token_ids) > 1 else None
        if data is None or any(p in self._bans for p in range(n, n + len(token_ids))):
            return super().accept_tokens(token_ids)  # one token, EOS / special, or bans
        state = self._states[-1]
        after = self._fed_state(state, data)
        if after is None:
            after = self.tracker.feed(state, data)
            if isinstance(after, str):
                return False  # refused by the bytes themselves: one of the tokens would be
        self._release()
        if not self.inner.accept_tokens(token_ids):
            return False
        self._forced_now = None
        self._states += [_LAZY] * (len(token_ids) - 1) + [after]
        self._tokens += token_ids
        self._tried = None
        return True

    def _state(self, k: int) -> Any:
        """``_states[k]`` (``0 <= k < len``), fed from the last known state before it if lazy."""
        states = self._states
        if states[k] is not _LAZY:
            return states[k]
        j = k
        while states[j] is _LAZY:
            j -= 1
        state = states[j]
        for i in range(j + 1, k + 1):
            state = self.tracker.feed(state, self.vocab.token_bytes[self._tokens[i - 1]] or b"")
            if isinstance(state, str):  # pieces of text fed at once refuse nothing more
                raise AssertionError(f"a lazy tracker state refused ({state})")
            states[i] = state
        return state

    def quick_refusals(self, token_ids: Sequence[int]) -> dict[int, str]:
        """Of ``token_ids`` (not EOS), those that ``check_token`` surely refuses by their first
        character alone (inside a string with a prefix check: ``first_char_refuser``), with the
        keyword; the others may pass or not (check them). Cheap: one prefix check per distinct
        first character, for a scan over many candidates."""
        refuser = self.tracker.first_char_refuser(self._states[-1])
        if refuser is None:
            return {}
        out = {}
        token_bytes = self.vocab.token_bytes
        for t in token_ids:
            data = token_bytes[t] if t not in self._eos else None
            keyword = refuser(data) if data else None
            if keyword is not None:
                out[t] = keyword
        return out

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._release()
        self.inner.fill_bitmask(bitmask, row)

    def fill_bitmask_loose(self, bitmask: torch.Tensor, row: int) -> bool:
        self._release()
        return self.inner.fill_bitmask_loose(bitmask, row)

    @property
    def loose_masks(self) -> bool:
        return self.inner.loose_masks

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()  # a held token is never EOS: no release needed

    def is_completed(self) -> bool:
        self._release()
        if self.inner.is_terminated():
            return True
        return self.inner.is_completed() and not isinstance(self.tracker.end(self._states[-1]), str)

    def only_eos_allowed(self) -> bool:
        return self.is_terminated() or (self.is_completed() and self.inner.only_eos_allowed())

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        self._release()
        self.inner.rollback(num_tokens)
        self._forced_now = None
        self._settled = None
        if num_tokens:
            del self._states[len(self._states) - num_tokens :]
            del self._tokens[len(self._tokens) - num_tokens :]
            self._state(len(self._states) - 1)  # the last state is never lazy
            position = len(self._tokens)
            self._bans = {p: b for p, b in self._bans.items() if p <= position}
            self._tried = None

    def fork(self) -> VerifiedMatcher:
        self._release()
        m = VerifiedMatcher(self.inner.fork(), self.tracker)
        m._states, m._tokens = list(self._states), list(self._tokens)
        m._bans = {p: dict(b) for p, b in self._bans.items()}
        m.num_rollbacks = self.num_rollbacks
        return m

    def num_settled(self) -> int:
        start = self.tracker.open_from(self._states[-1])
        if start is None:
            return len(self._tokens)
        if self._settled is not None and self._settled[0] == start:
            return self._settled[1]  # the tokens before ``start`` are as they were
        # The token that produced the first state past ``start`` began that value.
        position = self.tracker.position
        lo, hi = 0, len(self._states) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if position(self._state(mid)) > start:
                hi = mid
            else:
                lo = mid + 1
        self._settled = (start, max(0, lo - 1))
        return self._settled[1]

    def backtrack(self, floor: int, keyword: str, budget: int) -> int:
        """Leave a dead end: roll back the last accepted token and ban it at its position.
        Returns the tokens rolled back: 0 (nothing changed) when that token is one of the
        first ``floor`` (released to the client), none is accepted, or ``budget`` rollbacks
        were spent already."""
        n = len(self._tokens)
        if n == 0 or n - 1 < floor or self.num_rollbacks >= budget or self.is_terminated():
            return 0
        token = self._tokens[-1]
        self.rollback(1)
        self._bans.setdefault(n - 1, {})[token] = keyword
        self.num_rollbacks += 1
        return 1

    def forced_bytes(self) -> bytes:
        if self._forced_now is None:
            self._release()
            self._forced_now = self.inner.forced_bytes()
        return self._forced_now

    @property
    def num_accepted(self) -> int:
        return self.inner.num_accepted - (self._held is not None)


class VerifiedGrammar(CompiledGrammar):
    """``inner`` (a backend's compile of the relaxation) with ``tracker`` beside it."""

    def __init__(self, inner: CompiledGrammar, tracker: Tracker) -> None:
        super().__init__(inner.constraint, inner.backend, inner.vocab, inner.compile_time_s)
        self.inner = inner
        self.tracker = tracker

    def _make_matcher(self) -> VerifiedMatcher:
        return VerifiedMatcher(self.inner.new_matcher(), self.tracker)


def with_verifier(compiled: CompiledGrammar) -> CompiledGrammar:
    """``compiled`` with the verifier its schema (or its tools' parameters) needs, or as it is
    when the grammar alone enforces it. Every backend's ``compile`` ends here."""
    if isinstance(compiled, VerifiedGrammar):
        return compiled
    c = compiled.constraint
    if c.kind not in ("json_schema", "tool_calls"):
        return compiled
    support = getattr(get_backend(compiled.backend), "schema_support", None)
    tracker = tracker_for(c.kind, c.spec, support is None or support.names_as_patterns)
    return compiled if tracker is None else VerifiedGrammar(compiled, tracker)
