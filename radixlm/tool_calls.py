"""Tool calls: the text format a model writes them in, the ``tool_calls`` constraint's spec,
the default prompt block that teaches the format, and the one parser of generated text.

Top level (like ``config.py``) and torch-free: the grammar backends, the HTTP server and the
frontend DSL all use it, and ``import radixlm.lang`` must not import torch.

The format (Hermes / Qwen style; one block per call, blocks separated by ``"\\n"``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city":"Paris"}}
    </tool_call>

The arguments are JSON generated under the function's ``parameters`` schema with the same
whitespace mode and strictness as ``response_format``. A ``tool_calls`` constraint has a mode:

- ``required``: the whole output is one call (``parallel=False``) or one or more calls separated
  by ``"\\n"`` (``parallel=True``) of the listed tools; nothing else.
- ``auto``: free text until the trigger ``<tool_call>``; from there the call is constrained;
  after its end free text resumes (more calls with ``parallel``, none without).

``ToolCallParser`` turns generated text (all at once, or streamed deltas) into content text and
calls. Invariants: streamed ``feed`` deltas concatenate to what ``parse_tool_calls`` returns for
the whole text; content is ``None``-equivalent (``""``) when only whitespace surrounds the calls;
a call's argument fragments concatenate to the exact argument text the model generated.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from radixlm.runtime.grammar.schema_text import normalize_schema_text

TRIGGER = "<tool_call>"
CALL_HEADER = '\n{"name": "'  # after TRIGGER, before the name
ARGS_HEADER = '", "arguments": '  # after the name, before the arguments
CALL_END = "}\n</tool_call>"
CLOSE_TAG = "</tool_call>"
SEPARATOR = "\n"  # between parallel calls
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names

ToolMode = Literal["auto", "required"]


def call_begin(name: str) -> str:
    """The fixed text that opens a call of ``name``; the arguments follow it."""
    return f"{TRIGGER}{CALL_HEADER}{name}{ARGS_HEADER}"


def format_tool_call(name: str, arguments: str) -> str:
    """One call as the model writes it (used to render earlier assistant turns: the same text
    the model generated, so an agent loop's history is a cached prefix)."""
    return f"{call_begin(name)}{arguments}{CALL_END}"


class ToolSpecError(ValueError):
    """A malformed tool list / mode (the message names the problem)."""


@dataclass(frozen=True)
class ToolSpec:
    """One callable function: its name and the JSON schema of its arguments (canonical text)."""

    name: str
    parameters: str


@dataclass(frozen=True)
class ToolCallsSpec:
    """What a ``tool_calls`` constraint allows (see the module docstring)."""

    tools: tuple[ToolSpec, ...]
    mode: ToolMode = "required"
    parallel: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "required"):
            raise ToolSpecError(f"tool_calls mode must be auto or required, got {self.mode!r}")
        if not isinstance(self.parallel, bool):
            raise ToolSpecError(f"tool_calls parallel must be a bool, got {self.parallel!r}")
        if not self.tools:
            raise ToolSpecError("tool_calls needs at least one tool")
        seen: set[str] = set()
        for tool in self.tools:
            if not isinstance(tool.name, str) or not NAME_PATTERN.match(tool.name):
                raise ToolSpecError(
                    f"tool name must match [A-Za-z0-9_-]{{1,64}}, got {tool.name!r}"
                )
            if tool.name in seen:
                raise ToolSpecError(f"duplicate tool name {tool.name!r}")
            seen.add(tool.name)

    def to_json(self) -> str:
        data = {
            "mode": self.mode,
            "parallel": self.parallel,
            "tools": [{"name": t.name, "parameters": json.loads(t.parameters)} for t in self.tools],
        }
        return json.dumps(data, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> ToolCallsSpec:
        """Parse (and normalize) a spec given as JSON text or a mapping."""
        data: Any = text
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ToolSpecError(f"tool_calls: not valid JSON: {exc}") from None
        if not isinstance(data, Mapping):
            raise ToolSpecError("tool_calls must be a JSON object")
        unknown = set(data) - {"mode", "parallel", "tools"}
        if unknown:
            raise ToolSpecError(f"tool_calls: unknown keys {sorted(unknown)}")
        tools = data.get("tools")
        if not isinstance(tools, list):
            raise ToolSpecError("tool_calls.tools must be a list")
        specs = []
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping) or "name" not in t:
                raise ToolSpecError(f"tool_calls.tools[{i}] must be an object with a name")
            params = t.get("parameters", {"type": "object"})
            specs.append(ToolSpec(t["name"], normalize_schema_text(params)))
        return cls(tuple(specs), data.get("mode", "required"), data.get("parallel", False))


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The function object of an OpenAI tool (``{"type": "function", "function": {...}}``); a
    bare ``{"name": ..., "parameters": ...}`` is accepted as the function itself."""
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ToolSpecError(f"a tool must be a function with a name, got {dict(tool)!r}")
    return fn


def tool_calls_spec(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str | Mapping[str, Any] | None = "auto",
    parallel: bool = True,
) -> dict[str, Any] | None:
    """The ``tool_calls`` constraint spec for OpenAI-style ``tools`` / ``tool_choice`` /
    ``parallel_tool_calls``: ``"none"`` -> None (no constraint), ``"auto"`` / ``"required"`` ->
    that mode over all tools, a named function (``{"type": "function", "function": {"name":
    ...}}``) -> ``required`` over that tool alone."""
    fns = [function_of(t) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if isinstance(choice, Mapping):
        name = function_of(choice).get("name")
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise ToolSpecError(f"tool_choice names {name!r}, which is not among the tools")
        choice = "required"
    if choice not in ("auto", "required"):
        raise ToolSpecError(
            f"tool_choice must be none, auto, required or a named function, got {choice!r}"
        )
    items = [
        {"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}} for f in fns
    ]
    return {"mode": choice, "parallel": bool(parallel), "tools": items}


def normalize_tool_calls(spec: str | Mapping[str, Any]) -> str:
    """Canonical JSON text of a ``tool_calls`` spec (the constraint's cache key)."""
    return ToolCallsSpec.from_json(spec).to_json()


# ---- the prompt ----------------------------------------------------------------------------------

DEFAULT_TOOLS_PROMPT = """\
You may call the functions described below, given as JSON in <tools></tools>.
<tools>
{tools}
</tools>
To call a function, reply with one block per call, exactly in this form:
<tool_call>
{{"name": "<function name>", "arguments": <a JSON object of the arguments>}}
</tool_call>"""


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The default system block listing ``tools`` (OpenAI ``{"type": "function", "function":
    {...}}`` objects, one JSON line each) and the call format; used when the model's chat
    template does not render tools itself."""
    lines = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
    return DEFAULT_TOOLS_PROMPT.format(tools=lines)


# ---- the parser ----------------------------------------------------------------------------------

_END = re.compile(r"\}\s*" + re.escape(CLOSE_TAG))
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: ``name`` is set on the call's first piece only."""

    index: int
    arguments: str = ""
    name: str | None = None


@dataclass
class ParsedDelta:
    """What one ``feed`` / ``finish`` adds: content text and call pieces, in output order
    (content that precedes a call in the same delta is emitted first)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # the JSON text, as generated

    @property
    def args(self) -> Any:
        """The arguments, parsed (``json.JSONDecodeError`` for a truncated call)."""
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: tuple[ParsedToolCall, ...]
    complete: bool  # every call's end tag was seen


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolCallParser:
    """Incremental parser of the tool-call format. ``feed(text)`` takes each new piece of the
    generated text and returns what is certain so far; ``finish()`` flushes the rest. Text that
    might still turn out to be a trigger or a call's end is held back until it is decided;
    whitespace around calls is not content."""

    def __init__(self) -> None:
        self._buf = ""
        self._state: Literal["text", "header", "args"] = "text"
        self._pending_ws = ""  # whitespace seen in text, emitted only when text follows
        self._segment_start = True  # no content emitted in the current text segment yet
        self._content_emitted = False
        self._calls: list[list[str]] = []  # [name, arguments so far]
        self._closed = 0  # calls whose end tag was seen
        self._content = ""

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        while self._step(out, final=True):
            pass
        if self._state == "text":
            self._buf = ""  # only trailing whitespace can be left: not content
        elif self._state == "args" and self._buf:
            self._emit_args(out, self._buf)  # truncated call: what was generated
            self._buf = ""
        # a truncated header (no name yet) produces no call
        return out

    def result(self) -> ParsedOutput:
        return ParsedOutput(
            self._content,
            tuple(ParsedToolCall(n, a) for n, a in self._calls),
            self._closed == len(self._calls),
        )

    # -- states -----------------------------------------------------------------------------------

    def _step(self, out: ParsedDelta, final: bool) -> bool:
        """Consume what can be decided from the buffer; True when progress was made."""
        if self._state == "text":
            return self._step_text(out, final)
        if self._state == "header":
            return self._step_header(out)
        return self._step_args(out)

    def _step_text(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        at = buf.find(TRIGGER)
        if at >= 0:
            self._emit_text(out, buf[:at], final=True)
            self._pending_ws = ""
            self._buf = buf[at + len(TRIGGER) :]
            self._state = "header"
            return True
        hold = 0 if final else _partial_suffix(buf, TRIGGER)
        decided = buf[: len(buf) - hold]
        self._emit_text(out, decided, final=False)
        self._buf = buf[len(decided) :]
        return False

    def _emit_text(self, out: ParsedDelta, text: str, final: bool) -> None:
        """Content, minus whitespace at the edges of a segment (``final``: before a call)."""
        text = self._pending_ws + text
        self._pending_ws = ""
        if self._segment_start:
            text = text.lstrip()
        stripped = text.rstrip()
        if not final:
            self._pending_ws = text[len(stripped) :]
        if not stripped:
            return
        if self._segment_start and self._content_emitted:
            stripped = "\n" + stripped
        self._segment_start = False
        self._content_emitted = True
        out.content += stripped
        self._content += stripped

    def _step_header(self, out: ParsedDelta) -> bool:
        m = _HEADER.match(self._buf)
        if m is None:
            return False
        try:
            name = json.loads(f'"{m.group(1)}"')
        except json.JSONDecodeError:
            name = m.group(1)
        self._calls.append([name, ""])
        out.calls.append(ToolCallDelta(len(self._calls) - 1, name=name))
        self._buf = self._buf[m.end() :]
        self._state = "args"
        return True

    def _step_args(self, out: ParsedDelta) -> bool:
        buf = self._buf
        end = _END.search(buf)
        if end is not None:
            self._emit_args(out, buf[: end.start()])
            self._buf = buf[end.end() :]
            self._closed += 1
            self._state = "text"
            self._segment_start = True
            return True
        brace = buf.rfind("}")
        if brace >= 0 and CLOSE_TAG.startswith(buf[brace + 1 :].lstrip()):
            self._emit_args(out, buf[:brace])  # the end may be coming: hold from the brace on
            self._buf = buf[brace:]
        else:
            self._emit_args(out, buf)
            self._buf = ""
        return False

    def _emit_args(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        index = len(self._calls) - 1
        self._calls[index][1] += text
        if out.calls and out.calls[-1].index == index:
            out.calls[-1].arguments += text
        else:
            out.calls.append(ToolCallDelta(index, text))


def parse_tool_calls(text: str) -> ParsedOutput:
    """The content and calls of a whole generated text (the same parser as streaming)."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser.result()
