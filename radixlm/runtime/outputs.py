"""Result objects the Engine returns (boundary dataclasses, not dicts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.request import RequestOutput, TokenLogprob


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the radix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Completion:
    """One generated sequence (branch `index` of an n > 1 request)."""

    index: int
    text: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    error_code: str | None = None  # machine-readable cause of an "error" finish
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def add(self, delta: RequestOutput) -> None:
        self.text += delta.text
        self.output_token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.prompt_top_logprobs is not None:
            self.prompt_top_logprobs = delta.prompt_top_logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason
            self.error = delta.error
            self.error_code = delta.error_code


def sglang_finish_reason(
    reason: str | None, stop_reason: str | int | None, length: int, error: str | None = None
) -> dict[str, Any] | None:
    """SGLang's `meta_info.finish_reason`: `{"type": "stop", "matched": stop string, pattern or
    token id}`, `{"type": "length", "length": output tokens}`, `{"type": "abort" | "error"}`
    (with `"message"` when there is one); None while unfinished."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    return {"type": reason} if error is None else {"type": reason, "message": error}


@dataclass
class GenerateResult:
    request_id: str
    outputs: list[Completion]
    usage: Usage

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].output_token_ids

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        """With `logprob_start_len=k`: logprob of each prompt token at positions k.. (None at 0)."""
        return self.outputs[0].prompt_logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return next((o.error for o in self.outputs if o.error), None)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_used: int  # held by running requests
    kv_pages_cached: int  # in the radix cache with no holder (evictable)
    kv_pages_free: int
    page_size: int
    cache_hit_tokens: int
    cache_queried_tokens: int
    cache_hit_rate: float
    prompt_tokens: int  # prompt tokens of admitted requests
    computed_prompt_tokens: int  # prompt tokens actually run through the model (incl. recompute)
    generated_tokens: int
    num_retractions: int
    num_forwards: int  # model forward passes
    num_jump_forward_tokens: int  # output tokens appended by jump-forward, without a forward
    last_step_tokens: int
    last_step_seconds: float
    # Speculative decoding: drafts verified, their tokens, and those accepted (acceptance rate =
    # accepted / draft tokens; mean accepted length = accepted / drafts).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_decodes: int = 0  # decoding steps of requests while drafting was on (with or without)
    forward_tokens: int = 0  # rows of all forwards (prompt, decoded and verified draft tokens)
    # The second KV tier (`--enable-hierarchical-cache`; zeros when off): its pages and bytes,
    # the prompt tokens loaded from it instead of computed, the pages loaded and the seconds
    # spent loading, the pages written to it, those dropped as corrupt / foreign, failed writes.
    hicache_pages: int = 0
    hicache_bytes: int = 0
    hicache_capacity_bytes: int = 0
    hicache_hit_tokens: int = 0
    hicache_loaded_pages: int = 0
    hicache_load_seconds: float = 0.0
    hicache_stored_pages: int = 0
    hicache_dropped_pages: int = 0
    hicache_write_errors: int = 0
    # Grammar verifier (schemas beyond context-free), per keyword: {"masked", "resampled",
    # "dead_ends", "rollbacks"} counts (``constrained.KeywordStats``).
    verifier_events: dict[str, dict[str, int]] = field(default_factory=dict)
