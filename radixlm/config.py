"""Frozen configuration dataclasses. Every engine knob lives here and is validated once."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from radixlm.runtime.errors import ConfigError

# Weight-only quantization (`radixlm.runtime.quantization`): "none" keeps the checkpoint's floats,
# "int8" / "int4" quantize them at load time, "gguf" loads a .gguf's own blocks as they ship.
QUANTIZATION_MODES = ("none", "int8", "int4", "gguf")
LOAD_FORMATS = ("auto", "dummy")
# int4 group sizes offered (a linear whose K the chosen size does not divide takes the largest
# offered one that does: 128 does not divide SmolLM2's 576).
INT4_GROUP_SIZES = (32, 64, 128)
LM_HEAD_QUANTIZATIONS = ("int8", "int4")
HICACHE_WRITE_POLICIES = ("write_back", "write_through")
SPECULATIVE_ALGORITHMS = (None, "ngram", "draft")
# Draft tokens per request and step when `--speculative-num-draft-tokens` is not given. ngram:
# 8 (a lookup costs nothing per token; the expected-gain model verifies less where that pays,
# so batch 8 is unchanged); measured against 4 on an AVX512_BF16 EPYC, batch 1, same session:
# quote 3.36x -> 4.42x, edit 2.26x -> 2.68x, free 2.09x -> 2.39x, extract 1.85x -> 1.84x over
# plain decoding, batch 8 within 0.05x (README, "Speculative decoding"). draft: 4 (each draft
# token costs a draft-model forward).
DEFAULT_NUM_DRAFT_TOKENS = {"ngram": 8, "draft": 4}


@dataclass(frozen=True)
class CacheConfig:
    """KV cache geometry.

    The pool size is the first of: `num_pages` if set, else `kv_memory_bytes`, else
    `kv_memory_fraction` of the device's free memory (available RAM on CPU).
    """

    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float = 0.2
    enable_prefix_caching: bool = True
    # The second KV tier (SGLang's flag names): pages evicted from the pool are written to host
    # memory, or with `hicache_storage_dir` to page files there (found again after a restart),
    # bounded by `hicache_size` GB, and loaded back on a prefix match instead of recomputed.
    # A storage dir alone turns the tier on.
    enable_hierarchical_cache: bool = False
    hicache_size: float = 4.0
    hicache_storage_dir: str | None = None
    # "write_back": a page goes to the tier when it is evicted from the pool (and at a clean
    # shutdown); "write_through": also as soon as it is cached in the tree (a copy per computed
    # page on the loop thread; a crash then loses nothing the tier could have kept).
    hicache_write_policy: str = "write_back"
    # Models with sliding-window layers (Gemma 3): those layers' K/V live in a second page pool
    # of `swa_full_tokens_ratio` times the full layers' pages (SGLang's name), and pages outside
    # the window are released as a sequence advances. Off: every layer keeps every position.
    swa_full_tokens_ratio: float = 0.5
    disable_hybrid_swa_memory: bool = False

    @property
    def hicache_enabled(self) -> bool:
        """The tier is on (it needs the prefix cache)."""
        on = self.enable_hierarchical_cache or self.hicache_storage_dir is not None
        return on and self.enable_prefix_caching

    def __post_init__(self) -> None:
        if not self.hicache_size > 0:
            raise ConfigError(f"hicache_size must be > 0 (GB), got {self.hicache_size}")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ConfigError(
                f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, "
                f"got {self.hicache_write_policy!r}"
            )
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages must be >= 2, got {self.num_pages}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ConfigError(f"kv_memory_bytes must be > 0, got {self.kv_memory_bytes}")
        if not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ConfigError(
                f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}"
            )
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    `max_batched_tokens` is the per-step token budget shared by decodes (1 token each) and
    prefill chunks; `chunked_prefill_size` caps one request's chunk (None: no chunking, a prompt
    is prefilled whole even past the budget when it runs alone).
    """

    max_running_requests: int = 64
    max_batched_tokens: int = 2048
    chunked_prefill_size: int | None = 512
    # The prefill tokens of one step in all (SGLang's `--max-prefill-tokens`), shared by the
    # requests' chunks shortest remaining prompt first: a short prefill (a returning turn whose
    # history came from the cache) is not computed beside others' long chunks. None: only
    # `max_batched_tokens` bounds them (each request's chunk up to `chunked_prefill_size`).
    max_prefill_tokens: int | None = None
    schedule_policy: str = "lpm"
    # LPM aging: every second waited counts as this many matched prefix tokens, so no request
    # starves behind a stream of better-matching ones.
    aging_tokens_per_second: float = 256.0
    max_model_len: int | None = None
    # Speculative decoding (SGLang's flag names): "ngram" drafts up to
    # `speculative_num_draft_tokens` tokens per decode, without a draft model: the continuation
    # the radix tree holds after the whole sequence, else prompt lookup of its last
    # `speculative_ngram_max` .. `speculative_ngram_min` tokens; verified in the same forward.
    # "draft": a draft model (`EngineConfig.speculative_draft_model`) proposes them. None: off.
    speculative_algorithm: str | None = None
    # None: the algorithm's default (`DEFAULT_NUM_DRAFT_TOKENS`), resolved at construction.
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    # No drafting in a step with this many running requests or more (vLLM's
    # `disable_by_batch_size`): at large batches the forward is compute-bound and verifying
    # rejected drafts costs more than it saves.
    speculative_disable_by_batch_size: int = 16

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ConfigError("max_running_requests must be >= 1")
        if self.max_batched_tokens < 1:
            raise ConfigError("max_batched_tokens must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ConfigError("chunked_prefill_size must be >= 1 or None")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens must be >= 1 or None")
        if self.aging_tokens_per_second < 0:
            raise ConfigError("aging_tokens_per_second must be >= 0")
        if isinstance(self.speculative_algorithm, str):  # SGLang spells it NGRAM
            object.__setattr__(self, "speculative_algorithm", self.speculative_algorithm.lower())
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ConfigError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                f"got {self.speculative_algorithm!r}"
            )
        if self.speculative_num_draft_tokens is None:
            default = DEFAULT_NUM_DRAFT_TOKENS.get(self.speculative_algorithm, 4)
            object.__setattr__(self, "speculative_num_draft_tokens", default)
        if self.speculative_num_draft_tokens < 1:
            raise ConfigError("speculative_num_draft_tokens must be >= 1")
        if self.speculative_disable_by_batch_size < 1:
            raise ConfigError("speculative_disable_by_batch_size must be >= 1")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise ConfigError("need 1 <= speculative_ngram_min <= speculative_ngram_max")


def check_load_format(load_format: str, quantization: str) -> None:
    """The one check of `load_format` (the engine's config and a model runner built directly)."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "dummy" and quantization == "gguf":
        raise ConfigError("load_format 'dummy' cannot be combined with quantization 'gguf'")


@dataclass(frozen=True)
class EngineConfig:
    """Everything `Engine(**kwargs)` accepts besides the model."""

    model: str | None = None
    dtype: str = "bfloat16"
    device: str | None = None  # None: cuda if available, else cpu
    attention_backend: str = "auto"
    # CPU matmuls: "auto" computes in float32 where the CPU has no native bf16 (the KV cache keeps
    # `dtype`), "model" always in `dtype`, "float32" always in float32.
    matmul_dtype: str = "auto"
    num_threads: int | None = None  # torch intra-op threads on CPU; None: leave torch's choice
    # the reference forward (eager ATen ops, F.linear) instead of the compiled one (CPU:
    # oneDNN-prepacked linears and fused C++ layer ops); vLLM's name
    enforce_eager: bool = False
    # "auto": the checkpoint's weights; "dummy": random weights, config.json only (benchmarks of
    # a model's shape); vLLM's and SGLang's name
    load_format: str = "auto"
    # CUDA: decode batches of up to this many requests replay CUDA graphs (capped at
    # max_running_requests; 0 or disable_cuda_graph: none); SGLang's names
    cuda_graph_max_bs: int = 64
    disable_cuda_graph: bool = False
    # weight-only quantization of the linears, one of QUANTIZATION_MODES (KV cache stays `dtype`)
    quantization: str = "none"
    # int4 group size, one of INT4_GROUP_SIZES: 32 measured far more accurate on SmolLM2 than 64
    # (perplexity x1.49 at 64); 64 is ~10% faster at 1 row. README has the figures.
    quantization_group_size: int = 32
    # the LM head in a quantized mode, one of LM_HEAD_QUANTIZATIONS: int8 (shares the tied
    # embedding's copy) or int4 (faster at 1 row, less accurate; README)
    quantization_lm_head: str = "int8"
    # `speculative_algorithm="draft"`: the draft model's directory (or .gguf), sharing the
    # target's tokenizer, and its weight-only quantization (one of QUANTIZATION_MODES): the
    # default model drafting for itself with int4 weights is self-speculation.
    speculative_draft_model: str | None = None
    speculative_draft_quantization: str = "none"
    seed: int = 0
    debug_integrity: bool = False  # check_integrity() after every step
    # constrained decoding: "auto" (per constraint, the first of llguidance / xgrammar / outlines
    # that enforces all of it) or one of those by name
    grammar_backend: str = "auto"
    enable_jump_forward: bool = True  # append grammar-forced tokens without sampling them
    grammar_timeout_s: float = 30.0  # a grammar compiling longer fails its request
    # dead ends of the schema verifier one request may leave by rolling back a token
    grammar_max_rollbacks: int = 32
    tp_size: int = 1  # tensor parallel ranks (radixlm.runtime.distributed)
    nnodes: int = 1  # nodes the tp ranks span
    node_rank: int = 0  # this node's index (0 runs the scheduler)
    dist_init_addr: str | None = None  # "host:port" of rank 0; default MASTER_ADDR/MASTER_PORT
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(
                f"quantization must be one of {QUANTIZATION_MODES}, got {self.quantization!r}"
            )
        check_load_format(self.load_format, self.quantization)
        if self.load_format == "dummy" and self.tp_size > 1:
            raise ConfigError("load_format 'dummy' does not support tp_size > 1 yet")
        if self.cuda_graph_max_bs < 0:
            raise ConfigError(f"cuda_graph_max_bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ConfigError(
                f"quantization_group_size must be one of {INT4_GROUP_SIZES}, "
                f"got {self.quantization_group_size}"
            )
        if self.quantization_lm_head not in LM_HEAD_QUANTIZATIONS:
            raise ConfigError(
                f"quantization_lm_head must be one of {LM_HEAD_QUANTIZATIONS}, "
                f"got {self.quantization_lm_head!r}"
            )
        if self.speculative_draft_quantization not in QUANTIZATION_MODES:
            raise ConfigError(
                f"speculative_draft_quantization must be one of {QUANTIZATION_MODES}, "
                f"got {self.speculative_draft_quantization!r}"
            )
        drafting = self.scheduler.speculative_algorithm == "draft"
        if drafting != (self.speculative_draft_model is not None):
            raise ConfigError(
                "speculative_algorithm 'draft' and speculative_draft_model go together "
                "(--speculative-algorithm draft --speculative-draft-model PATH)"
            )
        if drafting and self.tp_size > 1:
            raise ConfigError("speculative_algorithm 'draft' does not support tp_size > 1 yet")
        if drafting and self.cache.hicache_enabled:
            # NOTE: pages loaded from the tier would carry no draft K/V (the tier stores the
            # target's); drafts would still be verified, but refuse the silent waste.
            raise ConfigError(
                "speculative_algorithm 'draft' does not support the hierarchical cache yet"
            )
        # NOTE: grammar_backend is checked against the registry by the Engine (importing it
        # here would pull in torch).
        if not self.grammar_timeout_s > 0:
            raise ConfigError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s}")
        if self.grammar_max_rollbacks < 0:
            raise ConfigError(
                f"grammar_max_rollbacks must be >= 0, got {self.grammar_max_rollbacks}"
            )
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {self.tp_size}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from flat keyword arguments: cache and scheduler fields may be given directly."""
        cache_names = {f.name for f in fields(CacheConfig)}
        sched_names = {f.name for f in fields(SchedulerConfig)}
        own_names = {f.name for f in fields(cls)} - {"cache", "scheduler"}
        cache_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in cache_names}
        sched_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in sched_names}
        unknown = set(kwargs) - own_names
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(cache=CacheConfig(**cache_kw), scheduler=SchedulerConfig(**sched_kw), **kwargs)
