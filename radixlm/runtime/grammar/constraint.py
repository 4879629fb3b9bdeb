"""The constraint spec: what a request's output must match (``Constraint``), normalized and
hashable (the compile-cache key). Torch-free: sampling params and the frontend import it without
loading any grammar backend."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.schema_text import normalize_schema_text
from radixlm.tool_calls import ToolSpecError, normalize_tool_calls

ConstraintKind = Literal["json_schema", "json_object", "regex", "ebnf", "choices", "tool_calls"]
Whitespace = Literal["compact", "any"]
CONSTRAINT_KINDS: tuple[str, ...] = get_args(ConstraintKind)
# Longest run of JSON whitespace between two JSON tokens in ``whitespace="any"`` mode.
MAX_JSON_WHITESPACE = 16


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
