"""radixlm: a prefix-caching, structured-generation LLM runtime.

Request flow::

    lang program / HTTP client
       -> Engine.submit(Request)                      thread-safe queue
       -> EngineCore.step():                          one iteration, on the engine thread
          Scheduler.schedule() -> ScheduledBatch
            admit waiting requests (policy: lpm / fcfs): RadixCache.match_prefix -> reuse pages
            budget: max_batched_tokens (prefill chunks + one token per decode)
            allocate pages from BlockPool (evict LRU cache leaves; retract if still short)
          Executor.run(batch) -> StepOutput
            ForwardBatch (persistent page table) -> ModelRunner.forward: one ragged forward
            attention: K/V written into pages and read in place; grammar masks; sampling
          Scheduler.update(batch, out) -> StepResult: tokens appended (TokenAppender: stop
            checks, incremental detokenization), computed pages into the RadixCache, finished
            requests released
          OutputProcessor.emit(result): deltas to the sinks

Public API: `Engine`, `SamplingParams`, and the frontend language (`radixlm.lang`), whose names
are re-exported here so that an SGLang program runs with `import radixlm as sgl`: `function`,
`gen`, `select`, `user`, `Runtime`, `RuntimeEndpoint`, `set_default_backend`, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
_LANG = (
    "Runtime", "RuntimeEndpoint", "ProgramState", "ProgramStateGroup", "Program", "SglFunction",
    "function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
    "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
    "set_default_backend", "get_default_backend", "flush_cache", "get_server_info", "var_scope",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
    "ChoicesSamplingMethod", "tool", "tools_prompt", "parse_tool_calls", "ParsedToolCall",
)  # fmt: skip
__all__ = ["Engine", "SamplingParams", "GenerateResult", "EngineStats", *_LANG]

if TYPE_CHECKING:
    from radixlm.runtime.engine import Engine
    from radixlm.runtime.outputs import EngineStats, GenerateResult
    from radixlm.runtime.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy: `import radixlm` stays cheap (no torch) until the engine is used.
    if name == "Engine":
        from radixlm.runtime.engine import Engine

        return Engine
    if name == "SamplingParams":
        from radixlm.runtime.sampling_params import SamplingParams

        return SamplingParams
    if name in ("GenerateResult", "EngineStats"):
        from radixlm.runtime import outputs

        return getattr(outputs, name)
    if name in _LANG:
        from radixlm import lang

        return getattr(lang, name)
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
