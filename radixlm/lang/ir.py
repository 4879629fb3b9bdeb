"""The intermediate representation of frontend programs: expressions a state executes.

`s += "text"`, `s += gen(...)`, `s += user(...)` each submit one `Expr` (an `ExprList` for a
concatenation such as `"Q: " + gen("a")`) to the state's executor. Sampling knobs live in
`GenParams`, where `None` means "inherit the program's default" (`Program.run(temperature=...)`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm.lang.choices import ChoicesSamplingMethod

REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+"
REGEX_BOOL = r"(True|False)"
REGEX_STRING = r"\"[\w\d\s]*\""
DTYPE_REGEX = {
    "int": REGEX_INT,
    "float": REGEX_FLOAT,
    "bool": REGEX_BOOL,
    "str": REGEX_STRING,
}


def dtype_name(dtype: type | str | None) -> str | None:
    """`int` / `"int"` -> `"int"`; None stays None; anything else is a `ValueError`."""
    if dtype is None:
        return None
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", repr(dtype))
    if name not in DTYPE_REGEX:
        raise ValueError(f"dtype must be one of int, float, bool, str, got {dtype!r}")
    return name


@dataclass(frozen=True)
class GenParams:
    """Sampling knobs of one `gen` (SGLang's names); `None` inherits the program default."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    dtype: str | None = None
    regex: str | None = None
    json_schema: str | None = None
    tool_calls: str | None = None  # a `tool_calls` constraint spec, as JSON text

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.stop, list):
            set_(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            set_(self, "stop_token_ids", tuple(self.stop_token_ids))
        set_(self, "dtype", dtype_name(self.dtype))
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            if not isinstance(self.json_schema, (Mapping, bool)):
                raise ValueError(f"json_schema must be a str or a dict, got {self.json_schema!r}")
            set_(self, "json_schema", json.dumps(self.json_schema))

    def merged(self, defaults: GenParams) -> GenParams:
        """These params with every `None` taken from `defaults`."""
        over = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        return dataclasses.replace(defaults, **over)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def constraint_kwargs(self) -> dict[str, str]:
        """`{"regex": ...}` / `{"json_schema": ...}` / `{"tool_calls": ...}` (a `dtype` is a
        regex), or `{}`."""
        given = {"regex": self.regex, "json_schema": self.json_schema}
        given["tool_calls"] = self.tool_calls
        if self.dtype is not None:
            given["dtype"] = DTYPE_REGEX[self.dtype]
        set_ = {k: v for k, v in given.items() if v is not None}
        if len(set_) > 1:
            raise ValueError(
                f"gen: at most one of regex, json_schema, dtype, tools, got {sorted(set_)}"
            )
        if "dtype" in set_:
            return {"regex": set_.pop("dtype")}
        return set_


DEFAULT_PARAMS = GenParams(
    max_new_tokens=128,
    min_new_tokens=0,
    n=1,
    stop=(),
    stop_token_ids=(),
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    min_p=0.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    ignore_eos=False,
    return_logprob=False,
    top_logprobs_num=0,
)


class Expr:
    """Base of every expression; `a + b` concatenates into an `ExprList` (str is `Constant`)."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*_flat(self), *_flat(as_expr(other))])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([*_flat(as_expr(other)), *_flat(self)])


def as_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(
        "a program state accepts str or an expression (gen, select, user(...), ...), "
        f"got {type(value).__name__}"
    )


def _flat(expr: Expr) -> list[Expr]:
    return list(expr.exprs) if isinstance(expr, ExprList) else [expr]


@dataclass(eq=False)
class ExprList(Expr):
    exprs: list[Expr] = field(default_factory=list)


@dataclass(eq=False)
class Constant(Expr):
    value: str


@dataclass(eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams


@dataclass(eq=False)
class Select(Expr):
    name: str | None
    choices: Sequence[str]
    temperature: float
    choices_method: ChoicesSamplingMethod


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class CommitLazy(Expr):
    """Send the text so far to the backend so that its cache holds it (before a fork)."""


def defined_names(expr: Expr) -> list[str | None]:
    """The variables an expression defines once executed."""
    if isinstance(expr, ExprList):
        return [n for e in expr.exprs for n in defined_names(e)]
    if isinstance(expr, (Gen, Select)):
        return [expr.name]
    if isinstance(expr, VarScopeBegin):
        return [expr.name]
    return []
