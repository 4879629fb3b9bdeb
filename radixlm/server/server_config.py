"""HTTP-side configuration of the server (the engine's is `radixlm.config.EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.sampling_params import MAX_N, MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side knobs (the engine's are in `radixlm.config.EngineConfig`)."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    max_n: int = 16  # most sequences (`n`) one request may ask for
    max_batch_prompts: int = 64  # most prompts in one batched request
    log_level: str = "info"
    dashboard_show_text: bool = False  # /dashboard shows prompt text, not only token-id hashes
    # ---- limits: each refusal is a 4xx naming the limit (and its flag)
    max_body_bytes: int = 8 * 2**20  # request body; 413 past it, enforced while reading
    max_prompt_chars: int | None = None  # before tokenizing; None: 16 x max_model_len
    max_stop_strings: int = 16
    max_stop_chars: int = 512  # length of one stop string
    max_top_logprobs: int = MAX_TOP_LOGPROBS
    max_constraint_chars: int = 65536  # JSON schema text / regex / EBNF grammar
    max_schema_depth: int = 32  # JSON nesting of a schema (objects and arrays)
    max_schema_nodes: int = 4096  # JSON values in a schema
    max_logit_bias: int = 300  # entries of logit_bias (OpenAI's limit)
    # ---- overload and deadlines
    max_queued_requests: int = 1024  # prompts submitted but not yet running; 503 past it
    request_timeout_s: float | None = None  # default per-request deadline (`timeout` overrides)
    shutdown_timeout_s: float = 30.0  # SIGTERM: running requests get this long to finish

    def __post_init__(self) -> None:
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be in [1, {MAX_N}], got {self.max_n}")
        if self.max_batch_prompts < 1:
            raise ValueError(f"max_batch_prompts must be >= 1, got {self.max_batch_prompts}")
        if not 0 <= self.max_top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        positive = (
            "max_body_bytes", "max_stop_strings", "max_stop_chars", "max_constraint_chars",
            "max_schema_depth", "max_schema_nodes", "max_queued_requests", "max_logit_bias",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1, got {self.max_prompt_chars}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
