"""The grammar backend interface and the backend registry.

A ``Constraint`` (what to generate; ``constraint.py``) is compiled by a ``GrammarBackend`` into a
``CompiledGrammar`` (immutable, shared, cached), from which each sequence gets its own
``GrammarMatcher`` (mutable parser state).

Matcher invariants (both backends, checked by the tests):

- The accepted tokens always spell a prefix of some string of the grammar.
- ``fill_bitmask`` allows token ``t`` exactly when ``accept_token(t)`` would succeed; EOS ids are
  allowed exactly when ``is_completed()`` (the text so far is a full match). A row is never empty:
  a non-completed state always has a continuation.
- Accepting an EOS id (only possible when completed) terminates the matcher; after that nothing
  but ``rollback`` changes it, and ``fill_bitmask`` allows only the EOS ids.
- ``rollback(n)`` undoes the last ``n`` accepted tokens (an accepted EOS counts as one), for any
  ``n <= num_accepted``.
- ``fork()`` returns an independent copy; ``CompiledGrammar.new_matcher(tokens)`` rebuilds the
  same state from the token history (retraction).
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from typing import ClassVar

import torch

from radixlm.runtime.grammar.bitmask import (
    allocate_bitmask,
    fill_bitmask_tokens,
    set_bitmask_bits,
)
from radixlm.runtime.grammar.constraint import Constraint, parse_choices
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.strict import SchemaSupport, check_schema
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.tool_calls import ToolCallsSpec


class GrammarMatcher(abc.ABC):
    """One sequence's parser state (see the module docstring for the invariants). Not
    thread-safe: owned by the engine's step thread."""

    # ``backtrack`` may roll back tokens after a dead end (a matcher with a verifier).
    can_backtrack: ClassVar[bool] = False

    def __init__(self, vocab: TokenVocab) -> None:
        self.vocab = vocab

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32 ``[B, ceil(V/32)]``,
        bit ``t % 32`` of word ``t // 32``; 1 = allowed). Does not change the state."""

    def fill_bitmask_loose(self, bitmask: torch.Tensor, row: int) -> bool:
        """``fill_bitmask``, or where that is much cheaper a superset of it (True): each token
        sampled from such a row must then pass ``check_token`` (``GrammarStep.verify``). Does
        not change the state."""
        self.fill_bitmask(bitmask, row)
        return False

    @property
    def loose_masks(self) -> bool:
        """``fill_bitmask_loose`` may give a superset."""
        return False

    def check_token(self, token_id: int) -> str | None:
        """The keyword refusing ``token_id`` (allowed by a loose mask, or by the relaxation a
        verifier checks: ``VerifiedMatcher``), else None. Does not change the state."""
        return None

    def quick_refusals(self, token_ids: Sequence[int]) -> dict[int, str]:
        """Of ``token_ids``, some that ``check_token`` surely refuses, found cheaply (with the
        keyword); the others may pass or not."""
        return {}

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """An EOS id was accepted."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """The accepted text is a full match: EOS is allowed now (or was accepted)."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (``0 <= num_tokens <= num_accepted``)."""

    @abc.abstractmethod
    def fork(self) -> GrammarMatcher:
        """An independent copy of this state (n > 1 branches)."""

    @abc.abstractmethod
    def forced_bytes(self) -> bytes:
        """The longest byte string every continuation of the grammar starts with (b"" when
        completed, terminated, or when there is a choice). Does not change the state."""

    @property
    @abc.abstractmethod
    def num_accepted(self) -> int:
        """Tokens accepted so far, an accepted EOS included."""

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Accept all tokens, or none: on a rejection the state is restored and False returned."""
        for i, t in enumerate(token_ids):
            if not self.accept_token(t):
                self.rollback(i)
                return False
        return True

    def only_eos_allowed(self) -> bool:
        """Completed and nothing but EOS can follow: the sequence may stop right now."""
        if self.is_terminated():
            return True
        if not self.is_completed():
            return False
        mask = allocate_bitmask(1, self.vocab.vocab_size)  # [1, W]
        self.fill_bitmask(mask, 0)
        set_bitmask_bits(mask, 0, self.vocab.eos_token_ids, allowed=False)
        return not bool(mask.any())

    def num_settled(self) -> int:
        """The accepted tokens that no dead end can take back (``backtrack``): all of them
        unless a verifier still checks an open value (``verified.VerifiedMatcher``)."""
        return self.num_accepted

    def backtrack(self, floor: int, keyword: str, budget: int) -> int:
        """Leave a dead end by rolling back; returns the tokens rolled back (0: cannot). A
        grammar alone never meets a dead end (a row always has a continuation)."""
        return 0

    def _check_rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted"
            )


class EosMatcher(GrammarMatcher):
    """A matcher over an engine that knows no EOS: the EOS ids, termination and the rollback of
    an accepted EOS are handled here, once. Subclasses give the engine's own steps: ``_fill``,
    ``_accepting``, ``_consume``, ``_rollback_consumed`` and ``_num_consumed``."""

    def __init__(self, vocab: TokenVocab, terminated: bool = False) -> None:
        super().__init__(vocab)
        self._terminated = terminated
        self._eos = frozenset(vocab.eos_token_ids)

    @abc.abstractmethod
    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The engine's allowed tokens into ``bitmask[row]`` (EOS ids: see ``fill_bitmask``)."""

    @abc.abstractmethod
    def _accepting(self) -> bool:
        """The engine is in a final state (EOS may come now)."""

    @abc.abstractmethod
    def _consume(self, token_id: int) -> bool:
        """Advance the engine by a non-EOS token; False (state unchanged) when refused."""

    @abc.abstractmethod
    def _rollback_consumed(self, num_tokens: int) -> None:
        """Undo the engine's last ``num_tokens`` consumed tokens."""

    @property
    @abc.abstractmethod
    def _num_consumed(self) -> int:
        """Tokens the engine consumed (EOS excluded)."""

    @property
    def num_accepted(self) -> int:
        return self._num_consumed + self._terminated

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            fill_bitmask_tokens(bitmask, row, self.vocab.eos_token_ids)
        else:
            self._fill(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self.vocab.vocab_size:
            return False
        if token_id in self._eos:
            if not self._accepting():
                return False
            self._terminated = True
            return True
        return self._consume(token_id)

    def is_terminated(self) -> bool:
        return self._terminated

    def is_completed(self) -> bool:
        return self._terminated or self._accepting()

    def rollback(self, num_tokens: int) -> None:
        self._check_rollback(num_tokens)
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens:
            self._rollback_consumed(num_tokens)


class CompiledGrammar(abc.ABC):
    """A compiled constraint: immutable, shared by all the matchers made from it."""

    def __init__(
        self, constraint: Constraint, backend: str, vocab: TokenVocab, compile_time_s: float
    ) -> None:
        self.constraint = constraint
        self.backend = backend
        self.vocab = vocab
        self.compile_time_s = compile_time_s

    @abc.abstractmethod
    def _make_matcher(self) -> GrammarMatcher: ...

    def new_matcher(self, tokens: Sequence[int] = ()) -> GrammarMatcher:
        """A fresh matcher, advanced through ``tokens`` (a sequence's generated tokens, to
        rebuild its state after retraction). Raises ``GrammarError`` if one is rejected."""
        matcher = self._make_matcher()
        for i, t in enumerate(tokens):
            if not matcher.accept_token(t):
                raise GrammarError(f"token {t} at output position {i} violates the grammar")
        return matcher

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.constraint.describe()}, backend={self.backend!r})"


class GrammarBackend(abc.ABC):
    """Compiles constraints for one model vocabulary. ``compile`` is thread-safe (the manager
    calls it from a pool) and raises ``GrammarError`` for anything the caller did wrong."""

    name: ClassVar[str]
    kinds: ClassVar[frozenset[str]]
    schema_support: ClassVar[SchemaSupport]

    def __init__(self, vocab: TokenVocab) -> None:
        self.vocab = vocab

    def validate(self, constraint: Constraint) -> None:
        """Checks before compiling: kind supported, schema valid against its metaschema and
        free of keywords this backend would ignore (unless best effort), regex / grammar syntax
        where the backend can parse it without precomputing masks (llguidance parses fully and
        keeps the result for ``compile``)."""
        self.check_semantics(constraint)
        self._validate_syntax(constraint)

    def check_semantics(self, constraint: Constraint) -> None:
        """``validate`` without the syntax hook (``compile`` parses anyway)."""
        if constraint.kind not in self.kinds:
            supported = ", ".join(sorted(self.kinds))
            raise GrammarError(
                f"{constraint.kind} constraints are not supported by the {self.name} grammar "
                f"backend (it supports {supported})"
            )
        if constraint.kind == "json_schema":
            check_schema(
                constraint.spec, self.schema_support, self.name, best_effort=constraint.best_effort
            )
        elif constraint.kind == "choices":
            parse_choices(constraint.spec)
        elif constraint.kind == "tool_calls":
            for tool in ToolCallsSpec.from_json(constraint.spec).tools:
                try:
                    check_schema(
                        tool.parameters,
                        self.schema_support,
                        self.name,
                        best_effort=constraint.best_effort,
                    )
                except GrammarError as exc:
                    raise GrammarError(f"tool {tool.name!r} parameters: {exc}") from None

    def _validate_syntax(self, constraint: Constraint) -> None:  # noqa: B027 - optional hook
        """Backend hook: parse regex / EBNF cheaply, raising ``GrammarError``."""

    @abc.abstractmethod
    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Validate and compile (can take from milliseconds to seconds)."""


# Backends by name. A backend module registers its class on import; modules are imported on
# first use (xgrammar alone takes ~2.5 s to import).
_BACKEND_MODULES: dict[str, str] = {
    "xgrammar": "radixlm.runtime.grammar.xgrammar_backend",
    "outlines": "radixlm.runtime.grammar.outlines_backend",
    "llguidance": "radixlm.runtime.grammar.llguidance_backend",
    "auto": "radixlm.runtime.grammar.auto_backend",
}
_BACKENDS: dict[str, type[GrammarBackend]] = {}


def register_backend(cls: type[GrammarBackend]) -> type[GrammarBackend]:
    """Class decorator: make ``cls`` available as ``get_backend(cls.name)``."""
    _BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str) -> type[GrammarBackend]:
    """The backend class registered under ``name`` (``auto``, ``llguidance``, ``xgrammar``,
    ``outlines``)."""
    if name not in _BACKENDS and name in _BACKEND_MODULES:
        importlib.import_module(_BACKEND_MODULES[name])
    try:
        return _BACKENDS[name]
    except KeyError:
        known = sorted({*_BACKENDS, *_BACKEND_MODULES})
        raise ValueError(f"unknown grammar backend {name!r}; known: {known}") from None


def backend_names() -> list[str]:
    return sorted({*_BACKENDS, *_BACKEND_MODULES})
