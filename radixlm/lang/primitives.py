"""The expressions a program adds to its state: `gen`, `gen_int`, `gen_string`, `select`, and
the role markers `system` / `user` / `assistant` (wrappers) and `*_begin` / `*_end`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from radixlm.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlm.lang.ir import Expr, ExprList, Gen, GenParams, RoleBegin, RoleEnd, Select, as_expr
from radixlm.tool_calls import tool_calls_spec

if TYPE_CHECKING:
    from radixlm.lang.state import ProgramState


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool = True,
) -> Expr:
    """Generate into variable `name`. With `choices`, this is `select`. `regex`, `json_schema`
    and `dtype` (int, float, bool, str) constrain the output. `tools` (OpenAI tool objects)
    with `tool_choice` (`"auto"` by default, `"required"`, `"none"` or `{"type": "function",
    "function": {"name": ...}}`) constrain tool calls written in the format of
    `radixlm.tool_calls` (show the model the tools with `tools_prompt(tools)`); read them back
    with `s.tool_calls(name)`. `logprob_start_len` and `return_text_in_logprobs` are accepted
    for compatibility and have no effect."""
    if choices:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            raise ValueError(f"gen: invalid regex {regex!r}: {exc}") from None
    spec = None
    if tools:
        spec = tool_calls_spec(tools, tool_choice, parallel_tool_calls)
    elif tool_choice not in (None, "none"):
        raise ValueError("gen: tool_choice needs tools")
    params = GenParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        n=n,
        stop=stop,  # type: ignore[arg-type]
        stop_token_ids=stop_token_ids,  # type: ignore[arg-type]
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num,
        dtype=dtype,  # type: ignore[arg-type]
        regex=regex,
        json_schema=json_schema,  # type: ignore[arg-type]
        tool_calls=json.dumps(spec) if spec is not None else None,
    )
    params.constraint_kwargs()  # at most one of regex / json_schema / dtype
    return Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """Generate an integer (its text, e.g. `"42"`: `int(s[name])`)."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """Generate a double-quoted string of word characters and spaces."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Pick one of `choices` by the model's logprobs of each after the text so far (all scored
    in one batch on top of the cached prefix). `temperature > 0` samples from the softmax of
    the method's scores instead of taking the best."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select: choices must be a non-empty list of non-empty str: {choices!r}")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise TypeError(f"select: choices_method must be a ChoicesSamplingMethod: {choices_method}")
    return Select(name, list(choices), float(temperature), choices_method)


def _role(role: str, expr: Any = None) -> ExprList:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    """`s += system("You are ...")`: a system message (rendered with the chat template)."""
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def tool(expr: Any = None) -> ExprList:
    """`s += tool(result)`: a tool result message (role `tool`) after a call."""
    return _role("tool", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def var_scope(state: ProgramState, name: str) -> AbstractContextManager[None]:
    """`with var_scope(s, "x"):` is `with s.var_scope("x"):`."""
    return state.var_scope(name)
