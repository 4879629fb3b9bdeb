"""radixlm: a prefix-caching, structured-generation LLM runtime.

Request flow::

    lang program / HTTP client
       -> Engine.submit(Request)                      thread-safe queue
       -> Scheduler.step():                           one iteration, on the engine thread
            admit waiting requests (policy: lpm / fcfs): RadixCache.match_prefix -> reuse pages
            budget: max_batched_tokens (prefill chunks + one token per decode)
            allocate pages from BlockPool (evict LRU cache leaves; retract if still short)
       -> ModelRunner.forward(ForwardBatch)           ragged: all new tokens in one tensor
            attention: K/V written into pages, read back through page tables
       -> Sampler -> OutputProcessor: append, stop checks, incremental detokenization
       -> finished: RadixCache.insert(full pages), release the request's page refs

Public API: `Engine`, `SamplingParams`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "GenerateResult", "EngineStats"]

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
    raise AttributeError(f"module 'radixlm' has no attribute {name!r}")
