"""Structured-output constraints (JSON schema, JSON object, regex, EBNF) as the HTTP API
receives them, turned into the engine's `Constraint`.

Where they come from: OpenAI `response_format` (`json_object`, or `json_schema` with its
`schema`), the `regex` / `ebnf` extra body fields, and the native `sampling_params.json_schema` /
`regex` / `ebnf`, and tool calls (`tools` / `tool_choice`, or the native
`sampling_params.tool_calls`: see `radixlm.server.tools`). `grammar_best_effort: true` (or an
explicit `json_schema.strict: false`) asks for best-effort decoding of schema keywords the
backend cannot enforce; `grammar_whitespace` (`"compact"`, the default, or `"any"`) controls
whitespace in generated JSON.

Every problem is a 400 naming the API field: too large (`radixlm.server.limits`), malformed
(`make_constraint`, no engine needed), then invalid / unsupported for the engine's grammar
backend (`Engine.submit`, run off the event loop; the message lists unsupported schema keywords
and where they are).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from starlette.concurrency import run_in_threadpool

from radixlm.runtime.grammar.constraint import Constraint, Whitespace
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.server.errors import ApiError

if TYPE_CHECKING:
    from radixlm.runtime.engine import Engine

logger = logging.getLogger(__name__)

ApiConstraintKind = Literal[
    "json_object", "json_schema", "regex", "ebnf", "structural_tag", "tool_calls"
]


@dataclass(frozen=True)
class RequestConstraint:
    """The engine's constraint plus the API field it came from (for error messages)."""

    constraint: Constraint
    param: str

    @property
    def kind(self) -> str:
        return self.constraint.kind

    @property
    def spec(self) -> str:
        return self.constraint.spec


def grammar_backend(engine: Engine) -> str | None:
    """The engine's grammar backend name, or None when it is not installed."""
    try:
        engine.grammar_manager  # noqa: B018 - created on first use
    except ValueError as exc:
        logger.warning("constrained decoding unavailable: %s", exc)
        return None
    return engine.config.grammar_backend


def grammar_available(engine: Engine) -> bool:
    return grammar_backend(engine) is not None


def make_constraint(
    kind: ApiConstraintKind,
    spec: Any,
    param: str,
    *,
    best_effort: bool = False,
    whitespace: Whitespace = "compact",
) -> RequestConstraint:
    """Build the constraint (400 naming `param` when malformed: not JSON, empty, ...)."""
    if kind == "structural_tag":
        raise ApiError(
            f"{param}: structural_tag constraints are not supported; use json_schema, regex or "
            "ebnf",
            param=param,
            code="unsupported_parameter",
        )
    common: dict[str, Any] = {"best_effort": best_effort, "whitespace": whitespace}
    try:
        if kind == "json_object":
            c = Constraint.from_params(json_object=True, **common)
        else:
            c = Constraint.from_params(**{kind: spec}, **common)
    except GrammarError as exc:
        raise ApiError(f"{param}: {exc}", param=param) from exc
    assert c is not None
    return RequestConstraint(c, param)


async def check_constraint(engine: Engine, rc: RequestConstraint) -> None:
    """Validate a constraint that is not submitted as it is (a tool's parameter schema; the
    submitted constraint is validated by `Engine.submit`): off the event loop, bounded by the
    engine's grammar timeout; a 400 naming the field, or a 503 past the timeout."""
    limit = engine.config.grammar_timeout_s

    def validate() -> None:
        engine.grammar_manager.validate(rc.constraint)

    try:
        await asyncio.wait_for(run_in_threadpool(validate), limit)
    except asyncio.TimeoutError:
        raise ApiError(
            f"{rc.param}: checking the constraint took longer than {limit:g} s "
            "(--grammar-timeout-s); simplify it",
            param=rc.param,
            status_code=503,
            code="grammar_timeout",
            headers={"Retry-After": "1"},
        ) from None
    except RecursionError:
        raise ApiError(f"{rc.param}: nested too deeply", param=rc.param) from None
    except ValueError as exc:  # GrammarError, or the backend is not installed
        raise ApiError(f"{rc.param}: {exc}", param=rc.param) from exc
