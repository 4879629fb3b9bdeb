"""OpenAI tool calling for `/v1/chat/completions`: request validation, the `tool_calls`
constraint, prompt rendering of tools and tool turns, and the response's `tool_calls`.

- `tool_choice` (default `"auto"` when `tools` are given): `"none"`: tools are shown, output is
  plain text (no constraint, no parsing); `"auto"`: free text or calls, a started call is
  constrained; `"required"` / a named function: the whole output is call(s), constrained.
  `parallel_tool_calls` (default true) allows more than one call.
- Arguments are constrained with `response_format`'s strictness: a keyword the grammar backend
  cannot enforce is a 400 naming `tools[i].function.parameters`, unless `grammar_best_effort`
  or that function's `strict: false`.
- Prompt: the model's chat template when it renders `tools` itself (detected by rendering a probe
  with and without tools), else the default system block of `tools_prompt` (prepended to the
  system message, or as the first one). Earlier assistant calls are rendered in the exact text
  the model generates, so an agent loop's history is a cached prefix.
- Output: one `ToolCallParser` per choice, fed the generated text (whole, or streamed deltas).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixlm.server.constraints import RequestConstraint, check_constraint, make_constraint
from radixlm.server.errors import ApiError
from radixlm.server.limits import check_constraint_size
from radixlm.server.protocol import ChatCompletionRequest, ChatTool
from radixlm.server.server_config import ServerConfig
from radixlm.tool_calls import (
    NAME_PATTERN,
    ParsedDelta,
    ToolCallParser,
    format_tool_call,
    tool_calls_spec,
    tools_prompt,
)

if TYPE_CHECKING:
    from radixlm.runtime.engine import Engine


@dataclass(frozen=True)
class ToolRequest:
    """The validated tool part of a chat request."""

    tools: list[dict[str, Any]]  # OpenAI tool objects, as rendered into the prompt
    mode: str  # "none" | "auto" | "required"
    constraint: RequestConstraint | None  # None for "none"

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def _tool_dict(tool: ChatTool) -> dict[str, Any]:
    fn = tool.function.model_dump(exclude_none=True)
    fn.setdefault("parameters", {"type": "object", "properties": {}})
    return {"type": "function", "function": fn}


async def tool_request(
    engine: Engine, cfg: ServerConfig, body: ChatCompletionRequest
) -> ToolRequest | None:
    """Validate `tools` / `tool_choice` / `parallel_tool_calls` (400s name the field) and build
    the constraint; None when the request has no tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError("tool_choice: requires tools", param="tool_choice")
        return None
    seen: dict[str, int] = {}
    for i, tool in enumerate(body.tools):
        name = tool.function.name
        if not NAME_PATTERN.match(name):
            raise ApiError(
                f"tools[{i}].function.name: must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got "
                f"{name!r}",
                param=f"tools[{i}].function.name",
            )
        if name in seen:
            raise ApiError(
                f"tools[{i}].function.name: duplicate tool name {name!r} (also "
                f"tools[{seen[name]}])",
                param=f"tools[{i}].function.name",
            )
        seen[name] = i
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        mode, allowed = choice, list(body.tools)
    else:
        name = choice.function.name
        if name not in seen:
            raise ApiError(
                f"tool_choice.function.name: {name!r} is not among tools ({', '.join(seen)})",
                param="tool_choice.function.name",
            )
        mode, allowed = "required", [body.tools[seen[name]]]
    if mode != "none":
        for param, other in (
            ("response_format", body.response_format),
            ("regex", body.regex),
            ("ebnf", body.ebnf),
        ):
            if other is not None and not (param == "response_format" and other.type == "text"):
                raise ApiError(
                    f"{param}: cannot be combined with tool_choice {mode!r} (use "
                    'tool_choice "none")',
                    param=param,
                )
    tools = [_tool_dict(t) for t in body.tools]
    kw = {"whitespace": body.grammar_whitespace}
    any_lax = body.grammar_best_effort
    for i, tool in enumerate(body.tools):
        # NOTE: every schema must be valid; strictness only matters for the ones constrained.
        lax = body.grammar_best_effort or tool.function.strict is False or mode == "none"
        lax = lax or tool not in allowed
        any_lax = any_lax or (lax and tool in allowed)
        params = tools[i]["function"]["parameters"]
        check_constraint_size(
            params,
            f"tools[{i}].function.parameters",
            cfg.max_constraint_chars,
            cfg.max_schema_depth,
            cfg.max_schema_nodes,
        )
        rc = make_constraint(
            "json_schema", params, f"tools[{i}].function.parameters", best_effort=lax, **kw
        )
        await check_constraint(engine, rc)
    named = body.tool_choice if not isinstance(body.tool_choice, str) else None
    spec = tool_calls_spec(tools, named.model_dump() if named else mode, body.parallel_tool_calls)
    if spec is None:
        return ToolRequest(tools, mode, None)
    param = "tool_choice" if mode == "auto" else "tools"
    rc = make_constraint("tool_calls", spec, param, best_effort=any_lax, **kw)
    return ToolRequest(tools, mode, rc)  # validated by `Engine.submit`


# ---- prompt --------------------------------------------------------------------------------------


def messages_for_template(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_has_tools: bool
) -> list[dict[str, Any]]:
    """The messages to render. With a tool-aware template: assistant `tool_calls` arguments
    become dicts (the Hugging Face convention). Otherwise: calls become the text the model
    writes, and the default tools block goes into the system message."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            if template_has_tools:
                m["tool_calls"] = [_hf_call(c) for c in calls]
            else:
                text = "\n".join(_call_text(c) for c in calls)
                m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
                del m["tool_calls"]
        out.append(m)
    if tools and not template_has_tools:
        block = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _function_of(call: dict[str, Any]) -> tuple[str, str]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError("messages: a tool_calls entry needs function.name", param="messages")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, separators=(",", ":"), ensure_ascii=False)
    return fn["name"], args


def _call_text(call: dict[str, Any]) -> str:
    return format_tool_call(*_function_of(call))


def _hf_call(call: dict[str, Any]) -> dict[str, Any]:
    name, args = _function_of(call)
    try:
        parsed: Any = json.loads(args)
    except json.JSONDecodeError:
        parsed = args
    fn = {"name": name, "arguments": parsed}
    return {"type": "function", "id": call.get("id"), "function": fn}


# ---- output --------------------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChoiceToolState:
    """One choice's parser and the ids of its calls (a call keeps its id across deltas)."""

    parser: ToolCallParser = field(default_factory=ToolCallParser)
    ids: list[str] = field(default_factory=list)

    def delta(self, text: str, finished: bool) -> ParsedDelta:
        out = self.parser.feed(text)
        if finished:
            tail = self.parser.finish()
            out.content += tail.content
            for c in tail.calls:
                if out.calls and out.calls[-1].index == c.index and c.name is None:
                    out.calls[-1].arguments += c.arguments
                else:
                    out.calls.append(c)
        return out

    def delta_tool_calls(self, delta: ParsedDelta) -> list[dict[str, Any]]:
        """OpenAI's streamed form: a call's first piece has index, id, type and name."""
        items = []
        for c in delta.calls:
            if c.name is not None:
                self.ids.append(new_call_id())
                fn = {"name": c.name, "arguments": c.arguments}
                head = {"index": c.index, "id": self.ids[c.index], "type": "function"}
                items.append({**head, "function": fn})
            else:
                items.append({"index": c.index, "function": {"arguments": c.arguments}})
        return items

    def message_tool_calls(self) -> list[dict[str, Any]]:
        result = self.parser.result()
        while len(self.ids) < len(result.calls):
            self.ids.append(new_call_id())
        return [
            {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for cid, c in zip(self.ids, result.calls)
        ]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` exactly when complete calls were made and generation ended on its own."""
        result = self.parser.result()
        if engine_reason == "stop" and result.calls and result.complete:
            return "tool_calls"
        return engine_reason
