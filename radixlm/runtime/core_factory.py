"""Building an engine core from an `EngineConfig`: the model runner (or rank 0 of a
tensor-parallel group), the page pool and radix cache, the scheduler with its token appender,
the executor and the output processor; and, on first use, the grammar manager.

The result (`EngineParts`) is plain wiring; the loop (`engine_loop.py`) drives it and the front
(`engine.py`) submits to it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from radixlm.config import CacheConfig, EngineConfig
from radixlm.kernels.forward_batch import KVCache
from radixlm.kernels.host_memory import keep_freed_memory
from radixlm.radix import BlockPool, HybridBlockPool, RadixCache
from radixlm.runtime.constrained import GrammarStep
from radixlm.runtime.cpu_threads import release_idle_teams
from radixlm.runtime.cuda_graph import SPEC_GRAPH_MAX_ROWS
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.errors import ConfigError
from radixlm.runtime.executor import Executor
from radixlm.runtime.grammar.base import backend_names
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.hicache_io import make_hicache
from radixlm.runtime.model_runner import DTYPES, ModelRunner, pick_device
from radixlm.runtime.models.loader import load_tokenizer, resolve_model_path
from radixlm.runtime.models.model_info import context_length, load_model_info
from radixlm.runtime.models.registry import check_architecture, check_tensor_parallel
from radixlm.runtime.output_processor import OutputProcessor
from radixlm.runtime.scheduler import Scheduler, TokenAppender

logger = logging.getLogger(__name__)


class EngineParts:
    """Everything one engine holds, wired. `num_threads`: the intra-op threads the forward
    runs on (the loop thread sets them for itself)."""

    def __init__(self, config: EngineConfig) -> None:
        cfg = self.config = config
        if cfg.grammar_backend not in backend_names():
            raise ConfigError(
                f"grammar_backend must be one of {backend_names()}, got {cfg.grammar_backend!r}"
            )
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        # NOTE: intra-op thread settings are per OS thread: the loop thread copies ours.
        self.num_threads = torch.get_num_threads()
        self.model_dir = resolve_model_path(cfg.model, need_weights=cfg.load_format != "dummy")
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model_info = load_model_info(self.model_dir)
        check_architecture(self.model_info.architecture)  # before any weight is read
        check_tensor_parallel(self.model_info.architecture, cfg.tp_size)
        self.device = pick_device(cfg.device)
        self.draft_dir, self.draft_info = self._draft_source()
        self.runner = self._make_runner()
        if self.device.type == "cpu":
            release_idle_teams()  # the loading thread's team; the loop thread makes its own
            keep_freed_memory()  # activations reused, not faulted in again by every forward
        self.max_model_len: int = self.runner.max_model_len
        num_swa_pages = getattr(self.runner, "num_swa_pages", None)
        if num_swa_pages is None:
            self.pool = BlockPool(self.runner.num_pages, cfg.cache.page_size)
        else:  # sliding-window layers: their own pages, released outside the window
            self.pool = HybridBlockPool(
                self.runner.num_pages, num_swa_pages, cfg.cache.page_size, self.runner.swa_window
            )
            self.runner.bind_swa_map(self.pool.swa_map)
        self.cache = RadixCache(self.pool, enabled=cfg.cache.enable_prefix_caching)
        self.hicache = make_hicache(
            cfg.cache, self.cache, self.runner, self.model_dir, self.tokenizer
        )
        eos = set(self.model_info.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.appender = TokenAppender(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.processor = OutputProcessor()
        proposer = self._make_draft_model()
        self.executor = Executor(self.runner, self.eos_token_ids, seed=cfg.seed, proposer=proposer)
        self.scheduler = Scheduler(
            self.pool,
            self.cache,
            cfg.scheduler,
            self.appender,
            self.max_model_len,
            debug_integrity=cfg.debug_integrity,
            hicache=self.hicache,
        )
        self.core = EngineCore(self.scheduler, self.executor, self.processor)
        self._grammar: GrammarManager | None = None
        self._grammar_lock = threading.Lock()

    def _cuda_graph_max_bs(self) -> int:
        """The most rows a replayed forward has (0: no graphs): decode batches of up to
        `cuda_graph_max_bs` requests; with speculative decoding also their verifications
        (k + 1 rows a request, up to `SPEC_GRAPH_MAX_ROWS`: `cuda_graph.DecodeGraphs` replays a
        short extend as decode rows)."""
        cfg = self.config
        if cfg.disable_cuda_graph:
            return 0
        sched = cfg.scheduler
        requests = min(cfg.cuda_graph_max_bs, sched.max_running_requests)
        if sched.speculative_algorithm is None:
            return requests
        rows = requests * (sched.speculative_num_draft_tokens + 1)
        return max(requests, min(rows, SPEC_GRAPH_MAX_ROWS))

    def _make_runner(self) -> Any:
        """A `ModelRunner`, or with `tp_size > 1` rank 0's `TensorParallelRunner` (which
        starts the other ranks and runs every forward on all of them)."""
        cfg = self.config
        args = (self.model_dir, cfg.dtype, self.device, cfg.cache, cfg.attention_backend)
        max_len = context_length(self.model_info, cfg.scheduler.max_model_len)
        if cfg.tp_size == 1:
            return ModelRunner(
                *args,
                max_len,
                model_info=self.model_info,
                matmul_dtype=cfg.matmul_dtype,
                enforce_eager=cfg.enforce_eager,
                quantization=cfg.quantization,
                quantization_group_size=cfg.quantization_group_size,
                quantization_lm_head=cfg.quantization_lm_head,
                extra_bytes_per_page=self._draft_bytes_per_page(),
                hybrid_swa=True,
                load_format=cfg.load_format,
                cuda_graph_max_bs=self._cuda_graph_max_bs(),
            )
        from radixlm.runtime.distributed.parallel_state import DistributedConfig
        from radixlm.runtime.distributed.tp_runner import TensorParallelRunner

        dist = DistributedConfig.from_env(
            cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr
        )
        if cfg.node_rank != 0:
            raise ValueError("node_rank > 0 runs tensor-parallel workers only (`radixlm serve`)")
        return TensorParallelRunner(
            *args,
            max_len,
            dist,
            num_threads=cfg.num_threads,
            quantization=cfg.quantization,
            quantization_group_size=cfg.quantization_group_size,
            quantization_lm_head=cfg.quantization_lm_head,
        )

    def _draft_source(self) -> tuple[Any, Any]:
        """`speculative_algorithm="draft"`: the draft model's directory and `ModelInfo`, refused
        before any weight is read when its tokenizer or vocabulary is not the target's; else
        (None, None)."""
        cfg = self.config
        if cfg.speculative_draft_model is None:
            return None, None
        from radixlm.runtime.spec.draft_model import check_same_tokenizer

        draft_dir = resolve_model_path(
            cfg.speculative_draft_model, need_weights=cfg.load_format != "dummy"
        )
        info = load_model_info(draft_dir)
        check_same_tokenizer(
            self.tokenizer,
            load_tokenizer(draft_dir),
            self.model_info.vocab_size,
            info.vocab_size,
            cfg.speculative_draft_model,
        )
        check_architecture(info.architecture)
        return draft_dir, info

    def _draft_bytes_per_page(self) -> int:
        """The draft model's K/V bytes per page (0 without one): its pool has the target's
        page count and is paid from the same KV budget."""
        info = self.draft_info
        if info is None:
            return 0
        dtype = DTYPES[self.config.dtype]
        ps = self.config.cache.page_size
        return KVCache.bytes_per_page(info.num_layers, ps, info.num_kv_heads, info.head_dim, dtype)

    def _make_draft_model(self) -> Any:
        """The draft model (`DraftModel`) over its own K/V buffers with the target's page
        geometry, or None."""
        cfg = self.config
        if self.draft_dir is None:
            return None
        from radixlm.runtime.spec.draft_model import DraftModel

        if self.draft_info.max_position_embeddings < self.max_model_len:
            raise ConfigError(
                f"speculative_draft_model {cfg.speculative_draft_model!r} holds "
                f"{self.draft_info.max_position_embeddings} positions, fewer than the target's "
                f"{self.max_model_len}: pass --max-model-len "
                f"{self.draft_info.max_position_embeddings} or less"
            )
        cache = CacheConfig(page_size=cfg.cache.page_size, num_pages=self.runner.num_pages)
        runner = ModelRunner(
            self.draft_dir,
            cfg.dtype,
            self.device,
            cache,
            cfg.attention_backend,
            self.max_model_len,
            model_info=self.draft_info,
            matmul_dtype=cfg.matmul_dtype,
            enforce_eager=cfg.enforce_eager,
            quantization=cfg.speculative_draft_quantization,
            quantization_group_size=cfg.quantization_group_size,
            quantization_lm_head=cfg.quantization_lm_head,
            load_format=cfg.load_format,
            cuda_graph_max_bs=self._cuda_graph_max_bs(),
        )
        return DraftModel(runner, self.eos_token_ids, seed=cfg.seed)

    @property
    def grammar(self) -> GrammarManager | None:
        """The grammar manager if one was created (None until the first constraint)."""
        return self._grammar

    @property
    def grammar_manager(self) -> GrammarManager:
        """The grammar manager (compile pool + cache), created on first use: importing a
        grammar backend costs seconds that unconstrained use should not pay. Raises
        `ValueError` when the configured backend is not installed."""
        with self._grammar_lock:
            if self._grammar is None:
                cfg = self.config
                try:
                    mgr = GrammarManager(
                        self.tokenizer,
                        self.runner.vocab_size,
                        self.eos_token_ids,
                        backend=cfg.grammar_backend,
                        timeout_s=cfg.grammar_timeout_s,
                        jump_forward_enabled=cfg.enable_jump_forward,
                    )
                except ImportError as exc:
                    raise ValueError(
                        f"grammar backend {cfg.grammar_backend!r} is not installed "
                        f"(pip install 'radixlm[grammar]'): {exc}"
                    ) from None
                step = GrammarStep(mgr, self.device, cfg.grammar_max_rollbacks)
                self.appender.set_grammar(step)
                self.executor.set_grammar(step)
                self._grammar = mgr
            return self._grammar
