"""Constraints, the grammar backend interface, and the backend registry.

A ``Constraint`` (what to generate) is compiled by a ``GrammarBackend`` into a
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
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch

from radixlm.runtime.grammar.bitmask import allocate_bitmask, set_bitmask_bits

if TYPE_CHECKING:
    from radixlm.runtime.grammar.strict import SchemaSupport
    from radixlm.runtime.grammar.vocab import TokenVocab

ConstraintKind = Literal["json_schema", "json_object", "regex", "ebnf", "choices", "tool_calls"]
Whitespace = Literal["compact", "any"]
CONSTRAINT_KINDS: tuple[str, ...] = get_args(ConstraintKind)
# Longest run of JSON whitespace between two JSON tokens in ``whitespace="any"`` mode.
MAX_JSON_WHITESPACE = 16


class GrammarError(ValueError):
    """A constraint that cannot be served: invalid, unsupported, or too slow to compile. The
    message is meant for the API caller (a 400) and names the problem."""


class GrammarTimeoutError(GrammarError):
    """Compilation did not finish within the manager's ``timeout_s``."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. Frozen and hashable: it is the compile-cache key.

    ``spec`` by kind: ``json_schema``: the schema as canonical JSON text (keyword keys sorted,
    ``properties`` order kept: it is the order of the generated keys); ``json_object``: ``""``
    (any JSON object); ``regex``: the pattern (full match); ``ebnf``: an xgrammar EBNF grammar
    with a ``root`` rule; ``choices``: a JSON list of the allowed strings; ``tool_calls``: a
    ``ToolCallsSpec`` as canonical JSON (tools with their ``parameters`` schemas, mode, parallel;
    see ``tool_calls.py``).

    ``best_effort``: generate even when the schema uses keywords the backend cannot enforce
    (they are then ignored) instead of raising; for ``tool_calls`` both apply to every tool's
    arguments. ``whitespace``: ``"compact"`` (default: no
    whitespace between JSON tokens, like ``json.dumps(separators=(",", ":"))``) or ``"any"``
    (up to ``MAX_JSON_WHITESPACE`` whitespace characters wherever JSON allows them).
    """

    kind: ConstraintKind
    spec: str = ""
    best_effort: bool = False
    whitespace: Whitespace = "compact"

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise GrammarError(
                f"constraint kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise GrammarError(f"{self.kind}: spec must be a str, got {type(self.spec).__name__}")
        if not isinstance(self.best_effort, bool):
            raise GrammarError(f"best_effort must be a bool, got {self.best_effort!r}")
        if self.whitespace not in get_args(Whitespace):
            raise GrammarError(
                f"whitespace must be one of {get_args(Whitespace)}, got {self.whitespace!r}"
            )
        if self.kind == "json_object" and self.spec:
            raise GrammarError("json_object takes no spec")
        if self.kind == "json_schema":
            object.__setattr__(self, "spec", normalize_schema_text(self.spec))
        elif self.kind == "choices":
            object.__setattr__(self, "spec", normalize_choices(self.spec))
        elif self.kind == "tool_calls":
            object.__setattr__(self, "spec", _normalize_tool_calls(self.spec))
        if self.kind not in ("json_schema", "json_object", "tool_calls"):
            # NOTE: no effect on these kinds; normalized so that they do not split the cache.
            object.__setattr__(self, "best_effort", False)
            object.__setattr__(self, "whitespace", "compact")

    @classmethod
    def from_params(
        cls,
        *,
        json_schema: str | Mapping[str, Any] | bool | None = None,
        regex: str | None = None,
        ebnf: str | None = None,
        choices: Sequence[str] | None = None,
        tool_calls: str | Mapping[str, Any] | None = None,
        json_object: bool = False,
        best_effort: bool = False,
        whitespace: Whitespace = "compact",
    ) -> Constraint | None:
        """The constraint that the request fields describe, or None when none is set.

        Raises ``GrammarError`` (a ``ValueError``) naming the field when more than one is set or
        one is malformed (not JSON, wrong type, empty). Deeper checks (metaschema, unsupported
        keywords, regex syntax) belong to ``GrammarManager.validate``.
        """
        given = {
            "json_schema": json_schema is not None,
            "regex": regex is not None,
            "ebnf": ebnf is not None,
            "choices": choices is not None,
            "tool_calls": tool_calls is not None,
            "json_object": bool(json_object),
        }
        names = [k for k, v in given.items() if v]
        if len(names) > 1:
            raise GrammarError(f"at most one constraint may be set, got {' and '.join(names)}")
        if not names:
            return None
        common: dict[str, Any] = {"best_effort": best_effort, "whitespace": whitespace}
        if json_schema is not None:
            return cls("json_schema", normalize_schema_text(json_schema), **common)
        if regex is not None:
            if not isinstance(regex, str) or not regex:
                raise GrammarError(f"regex must be a non-empty string, got {regex!r}")
            return cls("regex", regex, **common)
        if ebnf is not None:
            if not isinstance(ebnf, str) or not ebnf.strip():
                raise GrammarError(f"ebnf must be a non-empty string, got {ebnf!r}")
            return cls("ebnf", ebnf, **common)
        if choices is not None:
            return cls("choices", normalize_choices(choices), **common)
        if tool_calls is not None:
            return cls("tool_calls", _normalize_tool_calls(tool_calls), **common)
        return cls("json_object", "", **common)

    def describe(self) -> str:
        """Short human-readable form for logs and error messages."""
        spec = self.spec if len(self.spec) <= 60 else self.spec[:57] + "..."
        return f"{self.kind}({spec!r})" if spec else self.kind


def normalize_schema_text(schema: str | Mapping[str, Any] | bool) -> str:
    """Canonical JSON text of a schema given as JSON text, a mapping or a bool."""
    from radixlm.runtime.grammar.strict import (
        _MAX_DEPTH,
        MAX_SCHEMA_NODES,
        canonical_schema,
        check_json_shape,
    )

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"json_schema: not valid JSON: {exc}") from exc
        except RecursionError:
            raise GrammarError(f"json_schema nests deeper than {_MAX_DEPTH} levels") from None
    # NOTE: iterative, before anything that recurses over the schema (json.dumps, metaschema).
    check_json_shape(schema, "json_schema", _MAX_DEPTH, MAX_SCHEMA_NODES)
    if not isinstance(schema, (Mapping, bool)):
        raise GrammarError(
            f"json_schema must be a JSON object (or a bool), got {type(schema).__name__}"
        )
    schema = dict(schema) if isinstance(schema, Mapping) else schema
    return json.dumps(canonical_schema(schema), separators=(",", ":"), ensure_ascii=False)


def normalize_choices(choices: Sequence[str] | str) -> str:
    """Canonical JSON list text of the allowed strings (a list / tuple, or its JSON text; order
    kept, duplicates dropped)."""
    if isinstance(choices, str):
        try:
            parsed = json.loads(choices)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, list):
            raise GrammarError("choices must be a list of strings, got a str")
        choices = parsed
    items = list(choices) if isinstance(choices, (list, tuple)) else []
    if not items or not all(isinstance(c, str) for c in items):
        raise GrammarError(f"choices must be a non-empty list of strings, got {choices!r}")
    return json.dumps(list(dict.fromkeys(items)), ensure_ascii=False)


def _normalize_tool_calls(spec: str | Mapping[str, Any]) -> str:
    from radixlm.tool_calls import ToolSpecError, normalize_tool_calls

    try:
        return normalize_tool_calls(spec)
    except ToolSpecError as exc:
        raise GrammarError(str(exc)) from None


def parse_choices(spec: str) -> list[str]:
    """The strings of a (normalized) ``choices`` spec."""
    return list(json.loads(normalize_choices(spec)))


_REGEX_META = frozenset("\\.^$|?*+()[]{}")


def choices_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly the given strings, valid for both backends' dialects.

    Longer strings come first: outlines-core's DFA is leftmost-first, so ``a|ab`` would never
    reach ``ab`` there."""
    ordered = sorted(dict.fromkeys(choices), key=len, reverse=True)

    def escape(s: str) -> str:
        out = []
        for ch in s:
            if ch in _REGEX_META:
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\x{ord(ch):02x}")
            else:
                out.append(ch)
        return "".join(out)

    return "|".join(f"({escape(c)})" for c in ordered)


class GrammarMatcher(abc.ABC):
    """One sequence's parser state (see the module docstring for the invariants). Not
    thread-safe: owned by the engine's step thread."""

    def __init__(self, vocab: TokenVocab) -> None:
        self.vocab = vocab

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32 ``[B, ceil(V/32)]``,
        bit ``t % 32`` of word ``t // 32``; 1 = allowed). Does not change the state."""

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

    def _check_rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {self.num_accepted} were accepted"
            )


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
        from radixlm.runtime.grammar.strict import check_schema, verified_keywords

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
            from radixlm.tool_calls import ToolCallsSpec

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
                verified = verified_keywords(tool.parameters)
                if verified and not constraint.best_effort:
                    raise GrammarError(
                        f"tool {tool.name!r} parameters: JSON schema uses keywords that only "
                        f"the verifier enforces ({', '.join(verified)}), which tool calls do "
                        "not run yet. Remove them, or request best-effort decoding."
                    )

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
