"""ModelRunner: owns the model weights, the paged KV buffers and the attention backend."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixlm.config import CacheConfig, check_load_format
from radixlm.kernels.forward_batch import ForwardBatch, KVCache
from radixlm.kernels.hybrid import HybridAttention, HybridKVCache
from radixlm.kernels.registry import (
    create_attention_backend,
    preferred_kv_layout,
    resolve_backend_name,
)
from radixlm.runtime.cuda_graph import DecodeGraphs, GraphCapture
from radixlm.runtime.models.base import LogitsMask
from radixlm.runtime.models.registry import check_architecture, check_quantization, model_class

if TYPE_CHECKING:
    from radixlm.runtime.distributed.parallel_state import TensorParallelGroup
    from radixlm.runtime.models.model_info import ModelInfo

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device: CUDA free memory, or MemAvailable of the host."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _quant_summary(model) -> str:
    """`"120 x int4 group 32 from Q4_1 by aten._weight_int4pack_mm_for_cpu, ..."`."""
    from collections import Counter

    from radixlm.runtime.quantization import QuantEmbedding, QuantLinear

    kinds = Counter(
        f"int{m.bits} {'per channel' if m.bits == 8 else f'group {m.group_size}'} from "
        f"{m.source} by {m.kernel.name}"
        + (
            f" (from {m.kernel.dequant_min_rows} rows: dequantized)"
            if m.kernel.mm_dequantized is not None
            else " (every row count)"
        )
        for m in model.modules()
        if isinstance(m, QuantLinear)
    )
    out = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    emb = model.embed_tokens
    if isinstance(emb, QuantEmbedding):
        shared = isinstance(model.lm_head, QuantLinear) and emb.qweight is model.lm_head.qweight
        out += "; embedding int8 rows" + (" of the LM head's copy" if shared else "")
    return out


class ModelRunner:
    """Runs one ragged forward and returns float32 logits of the selected rows."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        device: torch.device,
        cache_config: CacheConfig,
        attention_backend: str = "auto",
        max_model_len: int | None = None,
        model_info: ModelInfo | None = None,
        tp: TensorParallelGroup | None = None,
        matmul_dtype: str = "auto",
        enforce_eager: bool = False,
        quantization: str = "none",
        quantization_group_size: int = 32,
        quantization_lm_head: str = "int8",
        extra_bytes_per_page: int = 0,
        hybrid_swa: bool = False,
        load_format: str = "auto",
        cuda_graph_max_bs: int = 0,
        graph_capture: GraphCapture | None = None,
    ) -> None:
        """`tp`: this rank's tensor-parallel group; the model and the KV buffers are then this
        rank's shard (`radixlm.runtime.distributed.sharding`). `matmul_dtype`: see
        `radixlm.runtime.models.cpu_linear` (the KV cache always has `dtype`). `enforce_eager`: run
        the reference model (eager ATen ops, `F.linear`) instead of the CPU compiled forward
        (oneDNN-prepacked linears, fused C++ layer ops). `quantization`: one of
        `radixlm.config.QUANTIZATION_MODES` (`radixlm.runtime.quantization`); a tensor-parallel
        rank quantizes its own shard. `extra_bytes_per_page`: the bytes per page of another
        pool with this one's page count (a draft model's K/V), paid from the same KV budget.
        `hybrid_swa`: the caller owns a `HybridBlockPool` and binds its page map
        (`bind_swa_map`), so sliding-window layers get their own, smaller KV buffers (see
        `_hybrid`); off, every layer has a page for every position. `load_format`: `auto`
        reads the checkpoint, `dummy` fills random weights (needs only config.json: benchmarks
        of a model's shape; vLLM's and SGLang's name). `cuda_graph_max_bs` > 0: decode-only
        forwards of up to that many requests replay CUDA graphs (`radixlm.runtime.cuda_graph`)
        where the forward is capturable (see `_graphs_unsupported`); `graph_capture` replaces
        the CUDA capture (tests)."""
        from radixlm.runtime.models.cpu_linear import compute_dtype
        from radixlm.runtime.models.model_info import load_model_info

        self.device = device
        self.dtype = DTYPES[dtype]  # the KV cache's (and, unless overridden, the compute's)
        self.compute_dtype = compute_dtype(self.dtype, device, matmul_dtype)
        info = model_info or load_model_info(model_dir)
        hf_config = info.hf_config
        arch = info.architecture
        check_architecture(arch)  # before any weight is read
        check_quantization(arch, quantization)
        self.hf_config = hf_config
        self.max_model_len = min(
            hf_config.max_position_embeddings, max_model_len or hf_config.max_position_embeddings
        )
        self.tp = tp
        self.quantization = quantization
        check_load_format(load_format, quantization)
        weights = None if load_format == "dummy" else self._checkpoint(model_dir, hf_config)
        model_config = hf_config
        if tp is not None and tp.world_size > 1:
            from radixlm.runtime.distributed import sharding

            spec = sharding.shard_spec(hf_config, tp.world_size, tp.rank)
            model_config = sharding.shard_config(hf_config, spec)
            if weights is not None:
                weights = sharding.shard_weights(weights, spec)
        self.model_config = model_config  # this rank's shapes (== hf_config without TP)
        with torch.device("meta"):
            model = model_class(arch)(model_config, max_positions=self.max_model_len)
            if model_config is not hf_config:
                sharding.parallelize(model, tp)
        model.to_empty(device=device)
        model.to(self.compute_dtype)
        model.tie_weights()
        if weights is None:
            from radixlm.runtime.models.loader import init_dummy_weights

            init_dummy_weights(model)
        staged = {} if weights is None else model.load_weights(weights)
        if staged:  # a GGUF's blocks
            from radixlm.runtime.quantization import install_quantized

            install_quantized(
                model, staged, self.compute_dtype, device, quantization_lm_head,
                quantization_group_size,
            )  # fmt: skip
        if quantization in ("int8", "int4"):
            from radixlm.runtime.quantization import quantize_model

            quantize_model(model, quantization, quantization_group_size, quantization_lm_head)
        # NOTE: non-persistent RoPE tables were on meta; rebuild them for real (float32).
        model.build_rope(hf_config, self.max_model_len, device)
        model.eval()
        self.model = model
        self.vocab_size = hf_config.vocab_size

        self.page_size = cache_config.page_size
        self.attention_backend_name = resolve_backend_name(attention_backend, device.type)
        layout = preferred_kv_layout(
            self.attention_backend_name, self.dtype, self.page_size, model.head_dim
        )
        # Sliding-window layers get their own page pool (`num_swa_pages`; None: one pool).
        self.windows: list[int] = model.sliding_windows()
        self.num_swa_pages: int | None = None
        if hybrid_swa and self._hybrid(cache_config):
            self.num_pages, self.num_swa_pages = self._num_hybrid_pages(
                cache_config, extra_bytes_per_page
            )
            self.kv_cache = HybridKVCache.allocate(
                self.windows, self.num_pages, self.num_swa_pages, self.page_size,
                model_config.num_key_value_heads, model.head_dim, self.dtype, device, layout,
            )  # fmt: skip
            self.attn = HybridAttention(self.attention_backend_name, self.kv_cache)
            graphs_off = "a hybrid sliding-window pool"
        else:
            self.num_pages = self._num_pages(cache_config, extra_bytes_per_page)
            if tp is not None and tp.world_size > 1:
                # Page ids are the scheduler's (rank 0's): every rank needs the same pool size.
                self.num_pages = tp.min_over_ranks(self.num_pages)
            graphs_off = self._graphs_unsupported(cuda_graph_max_bs, enforce_eager, graph_capture)
            # NOTE: with graphs, one page past the pool's: the padding rows' scratch page.
            self.kv_cache = KVCache.allocate(
                hf_config.num_hidden_layers,
                self.num_pages + (graphs_off is None),
                self.page_size,
                model_config.num_key_value_heads,
                model.head_dim,
                self.dtype,
                device,
                layout,
            )
            self.attn = create_attention_backend(self.attention_backend_name, self.kv_cache)
        self.enforce_eager = enforce_eager
        self.layer_ops, self.linear_method = self._prepare_forward(model)
        self.decode_graphs: DecodeGraphs | None = None
        if graphs_off is None:
            self.decode_graphs = DecodeGraphs(
                model, self.attn, self.page_size, self.max_model_len, self.scratch_page,
                cuda_graph_max_bs, device, graph_capture,
            )  # fmt: skip
            self.decode_graphs.capture_all()
            logger.info(
                "CUDA graphs: decode batches of %s requests captured in %.1f s",
                self.decode_graphs.buckets, self.decode_graphs.capture_seconds,
            )  # fmt: skip
        elif device.type == "cuda":
            logger.info("CUDA graphs off: %s", graphs_off)
        from radixlm.runtime.models.weight_bytes import resident_weight_bytes

        self.weight_bytes = resident_weight_bytes(model)
        logger.info(
            "model %s (%s) on %s: %d KV pages%s of %d tokens, attention=%s, layer ops=%s, "
            "linears=%s, quantization=%s, weights %.1f MB resident",
            model_dir.name,
            arch,
            device,
            self.num_pages,
            "" if self.num_swa_pages is None else f" (+ {self.num_swa_pages} window-layer pages)",
            self.page_size,
            self.attention_backend_name,
            self.layer_ops,
            self.linear_method,
            quantization,
            self.weight_bytes / 1e6,
        )

    @property
    def scratch_page(self) -> int:
        """The page past the pool's that CUDA graphs' padding rows write (allocated only with
        graphs; no request ever holds it)."""
        return self.num_pages

    def _graphs_unsupported(
        self, max_bs: int, enforce_eager: bool, capture: GraphCapture | None
    ) -> str | None:
        """Why decode forwards do not replay graphs here (None: they do)."""
        if max_bs <= 0:
            return "cuda_graph_max_bs 0"
        if enforce_eager:
            return "enforce_eager"
        if self.attention_backend_name != "triton":
            return f"attention backend {self.attention_backend_name!r} plans on the host"
        if self.device.type != "cuda" and capture is None:
            return f"device {self.device.type}"
        if self.tp is not None and self.tp.world_size > 1:
            return "tensor parallel (the all-reduce is not captured)"
        return None

    def _checkpoint(self, model_dir: Path, hf_config):
        """The checkpoint's `(name, tensor)` stream: the safetensors, or with `gguf` the source
        .gguf's tensors, its mapped block types as `QuantizedWeight`s."""
        if self.quantization != "gguf":
            from radixlm.runtime.models.loader import iter_safetensors

            return iter_safetensors(model_dir)
        from radixlm.runtime.models.loader import gguf_source
        from radixlm.runtime.quantization.gguf_reader import iter_gguf

        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return iter_gguf(gguf_source(model_dir), heads, kv_heads)

    def _prepare_forward(self, model) -> tuple[str, str]:
        """Choose the forward's layer ops and linears (after the weights are loaded); returns
        their names. CPU: fused C++ ops and oneDNN-prepacked linears unless `enforce_eager`
        (where the op cannot be built, one log line and the torch twins). CUDA + triton:
        Triton norms and RoPE. The weights of CPUs without native bf16 compute in fp32 with a
        bf16 copy for few-row inputs (`cpu_linear`)."""
        from radixlm.kernels.layer_ops import get_layer_ops
        from radixlm.runtime.models.cpu_linear import (
            add_lowp_copies,
            bf16_kernel_supported,
            move_weights_to_huge_pages,
            onednn_available,
            pack_linears,
        )

        lowp = self.dtype if self.compute_dtype != self.dtype else None
        ops = get_layer_ops("torch")
        if self.attention_backend_name == "triton":
            ops = get_layer_ops("triton")
        elif self.device.type == "cpu" and not self.enforce_eager:
            try:
                ops = get_layer_ops("cpu")
            except ImportError as e:
                logger.warning("fused CPU layer ops unavailable (%s); using the torch twins", e)
        model.set_layer_ops(ops)
        linears = "dense"
        if self.device.type == "cpu" and not self.enforce_eager and onednn_available():
            pack_linears(model, lowp, bf16_kernel=bf16_kernel_supported())
            move_weights_to_huge_pages(model)  # before the stack keeps references to them
            linears = "onednn-prepacked"
            kernel = next(
                (m for m in model.modules() if getattr(m, "weight_bf16", None) is not None), None
            )
            if kernel is not None:
                most = kernel.bf16_max_rows
                linears = "radixlm bf16 packed" + (
                    "" if most >= sys.maxsize else f" (inputs of <= {most} rows; oneDNN above)"
                )
                if kernel.kernel_dtype == torch.float32:
                    linears += " on fp32 activations"
            from radixlm.runtime.models.cpu_stack import CpuDecoderStack

            why_not = CpuDecoderStack.unsupported_reason(model, self.attn)
            if why_not is None:
                model.stack = CpuDecoderStack(model, self.attn)
                linears += ", one decoder_stack call per forward"
                if model.stack.max_rows is not None:
                    linears += f" of up to {model.stack.max_rows} rows"
            else:
                logger.info("layers run from Python: %s", why_not)
        elif lowp is not None:
            add_lowp_copies(model, lowp)
        if self.quantization != "none":
            summary = _quant_summary(model)
            linears = f"{self.quantization} weight-only ({summary}); the rest {linears}"
        if lowp is not None:
            logger.info(
                "this CPU has no native %s matmul: weights compute in %s (a %s copy for few-row "
                "inputs); KV cache in %s",
                self.dtype,
                self.compute_dtype,
                self.dtype,
                self.dtype,
            )
        return ops.name, linears

    def _num_pages(self, cc: CacheConfig, extra_bytes_per_page: int = 0) -> int:
        cfg = self.model_config
        per_page = KVCache.bytes_per_page(
            cfg.num_hidden_layers,
            cc.page_size,
            cfg.num_key_value_heads,
            self.model.head_dim,
            self.dtype,
        )
        if cc.num_pages is not None:
            return cc.num_pages
        budget = cc.kv_memory_bytes or int(
            available_memory_bytes(self.device) * cc.kv_memory_fraction
        )
        # Never more than enough for a full pool of max-length sequences: 64 of them is plenty.
        cap = 64 * (self.max_model_len // cc.page_size + 1)
        return max(2, min(budget // (per_page + extra_bytes_per_page), cap))

    @property
    def swa_window(self) -> int:
        """The widest sliding window (the hybrid pool releases pages outside it)."""
        return max(self.windows, default=0)

    def _hybrid(self, cc: CacheConfig) -> bool:
        """Whether window layers get their own pool: some layer has a window, some page can
        be released, and nothing needs every layer's K/V in one page (the second tier's page
        codec; tensor-parallel workers, which get no window page map)."""
        if cc.disable_hybrid_swa_memory or cc.hicache_enabled or self.swa_window == 0:
            return False
        if self.tp is not None and self.tp.world_size > 1:
            return False
        return self.swa_window < self.max_model_len

    def _num_hybrid_pages(self, cc: CacheConfig, extra_bytes_per_page: int = 0) -> tuple[int, int]:
        """(full pages, window pages): `num_pages` full pages if set, else the budget split so
        that window pages = `swa_full_tokens_ratio` x full pages (and `extra_bytes_per_page`
        paid per full page)."""
        per_full, per_window = HybridKVCache.bytes_per_page(
            self.windows, cc.page_size, self.model_config.num_key_value_heads,
            self.model.head_dim, self.dtype,
        )  # fmt: skip
        ratio = cc.swa_full_tokens_ratio
        if cc.num_pages is not None:
            full = cc.num_pages
        else:
            budget = cc.kv_memory_bytes or int(
                available_memory_bytes(self.device) * cc.kv_memory_fraction
            )
            cap = 64 * (self.max_model_len // cc.page_size + 1)
            per = per_full + ratio * per_window + extra_bytes_per_page
            full = max(2, min(int(budget // per), cap))
        return full, max(1, math.ceil(ratio * full))

    def bind_swa_map(self, swa_map) -> None:
        """The page pool's full -> window page map (`HybridBlockPool.swa_map`), read zero-copy
        by the window layers' attention."""
        assert isinstance(self.kv_cache, HybridKVCache)
        self.kv_cache.bind_swa_map(torch.frombuffer(swa_map, dtype=torch.int32))

    def forward(
        self, batch: ForwardBatch, logits_mask: LogitsMask | None = None
    ) -> torch.Tensor:  # [R, V] float32
        """The logits of `batch.logits_indices`: a decode graph's replay where one serves the
        batch, else the eager forward. `logits_mask`: grammar masks the LM head may write
        into the logits (`Model.forward`; a graph never calls it)."""
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run(batch)
            if logits is not None:
                return logits
        return self.forward_eager(batch, logits_mask)

    def forward_eager(
        self, batch: ForwardBatch, logits_mask: LogitsMask | None = None
    ) -> torch.Tensor:  # [R, V] float32
        self.attn.init_forward(batch)
        return self.model(batch, self.attn, logits_mask)
