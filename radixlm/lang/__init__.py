"""The frontend language: SGLang's programming surface, so that an SGLang program runs with its
import changed to `import radixlm as sgl`.

    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a terse assistant.")
        with s.user():
            s += question
        with s.assistant():
            s += sgl.gen("answer", max_tokens=32)

    sgl.set_default_backend(sgl.Runtime(dtype="float32"))   # or sgl.RuntimeEndpoint(url)
    print(qa.run(question="What is 2+2?")["answer"])

`Runtime` (in-process `Engine`) and `RuntimeEndpoint` (HTTP) are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.lang.primitives import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    tool,
    user,
    user_begin,
    user_end,
    var_scope,
)
from radixlm.lang.program import Program, function, get_default_backend, set_default_backend
from radixlm.lang.state import ProgramState, ProgramStateGroup
from radixlm.tool_calls import ParsedToolCall, parse_tool_calls, tools_prompt

if TYPE_CHECKING:
    from radixlm.lang.backend.endpoint import RuntimeEndpoint
    from radixlm.lang.backend.runtime import Runtime

SglFunction = Program

__all__ = [
    "BaseBackend",
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "ParsedToolCall",
    "Program",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "SglFunction",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "greedy_token_selection",
    "parse_tool_calls",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "tool",
    "tools_prompt",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "var_scope",
]


def flush_cache(backend: BaseBackend | None = None) -> bool:
    """Drop the backend's radix cache (default backend when None); False when it could not."""
    backend = backend or get_default_backend()
    return backend.flush_cache() if backend is not None else False


def get_server_info(backend: BaseBackend | None = None) -> dict[str, Any] | None:
    """The backend's engine stats (the server's `/get_server_info` for an endpoint)."""
    backend = backend or get_default_backend()
    if backend is None:
        return None
    info = getattr(backend, "get_server_info", None)
    return info() if info is not None else {"engine_stats": backend.stats()}


def __getattr__(name: str) -> Any:
    if name == "Runtime":
        from radixlm.lang.backend.runtime import Runtime

        return Runtime
    if name == "RuntimeEndpoint":
        from radixlm.lang.backend.endpoint import RuntimeEndpoint

        return RuntimeEndpoint
    raise AttributeError(f"module 'radixlm.lang' has no attribute {name!r}")
