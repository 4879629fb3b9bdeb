"""Structured-output constraints (JSON schema, regex, EBNF) as the HTTP API receives them.

The grammar issue has not landed yet: every endpoint turns `response_format` json_object /
json_schema, `regex`, `ebnf` (and native `sampling_params.json_schema` / `regex` / `ebnf` /
`structural_tag`) into a `Constraint` on the internal `GenerationRequest`, checks its syntax
(a 400 naming the field when malformed), and then `check_constraint` refuses it with a 400 that
says so, instead of silently generating unconstrained text. Wiring grammars in is this file's
`grammar_available` plus passing `GenerationRequest.constraint` to the engine in
`serving.RequestGroup`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson

from radixlm.server.errors import ApiError

if TYPE_CHECKING:
    from radixlm.runtime.engine import Engine

ConstraintKind = Literal["json_object", "json_schema", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint as the API gave it; `param` names the API field."""

    kind: ConstraintKind
    spec: str  # JSON schema text, regex, EBNF grammar, or "" for json_object
    param: str


def grammar_available(engine: Engine) -> bool:
    """Whether constrained decoding is wired up.

    NOTE: the one place the grammar issue changes: make this report the engine's grammar
    backend, and pass `GenerationRequest.constraint` through in `RequestGroup.__init__`.
    """
    return False


def make_constraint(kind: ConstraintKind, spec: Any, param: str) -> Constraint:
    """Check a constraint's syntax (400 naming `param` when malformed) and wrap it."""
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = orjson.loads(spec)
            except orjson.JSONDecodeError as exc:
                raise ApiError(f"{param}: not valid JSON: {exc}", param=param) from exc
        if not isinstance(spec, dict):
            raise ApiError(f"{param}: a JSON schema must be an object", param=param)
        text = orjson.dumps(spec).decode()
    elif kind == "regex":
        try:
            re.compile(spec)
        except re.error as exc:
            raise ApiError(f"{param}: invalid regular expression: {exc}", param=param) from exc
        text = spec
    elif kind in ("ebnf", "structural_tag"):
        if not isinstance(spec, str) or not spec.strip():
            raise ApiError(f"{param}: must be a non-empty string", param=param)
        text = spec
    else:
        text = ""
    return Constraint(kind=kind, spec=text, param=param)


def check_constraint(engine: Engine, constraint: Constraint | None) -> None:
    if constraint is not None and not grammar_available(engine):
        raise ApiError(
            f"{constraint.param}: {constraint.kind} constrained decoding is not supported yet: "
            "grammar backend not installed",
            param=constraint.param,
            code="unsupported_parameter",
        )
