"""`CpuAttentionBackend` ("cpu"): paged attention by a compiled C++/OpenMP op that reads K/V in
place through the page table (no per-layer gather copy), same interface as the torch twin.

Per forward, `init_forward` plans once for all layers a list of work items (see
`paged_attention.cpp`): a decode row is one item, or several split-KV items plus a reduce when the
batch is too small to keep the threads busy and its context is long (flash-decoding); an extend
request is one item per block of `extend_block` query rows over its prefix and causally over
itself. An item is one task over all KV heads (a page's rows are read sequentially); items are
sorted longest first and handed out dynamically to torch's intra-op threads.
Per layer, `forward` stores the new K/V into their slots (the compiled `store_kv`) and makes one op
call for the whole batch.
"""

from __future__ import annotations

import logging

import torch

from radixlm.kernels.cpu.build import load_error, load_op
from radixlm.kernels.cpu.fused import store_kv
from radixlm.kernels.cpu.plan import PlanConfig, WorkPlan, plan_work
from radixlm.kernels.forward_batch import KV_LAYOUTS, ForwardBatch, KVCache
from radixlm.kernels.reference import TorchAttentionBackend
from radixlm.kernels.registry import register_attention_backend

logger = logging.getLogger(__name__)
# Extends of up to this many rows plan as shared-prefix items of their own rows on pairs16.
SMALL_EXTEND_ROWS = 8

_op = load_op()
if _op is None:
    raise ImportError(f"the compiled CPU attention op could not be built or loaded: {load_error()}")


@register_attention_backend("cpu")
class CpuAttentionBackend:
    """Compiled CPU paged attention over a `KVCache` (bf16 / fp16 / fp32 K/V, fp32 accumulate).

    `force_num_kv_splits` overrides the split-KV heuristic for every decode row of length >= 2
    (tests, benchmarks); `extend_block` is the query rows per extend work item.
    """

    @staticmethod
    def preferred_kv_layout(dtype: torch.dtype, page_size: int, head_dim: int) -> str:
        """`pairs16` where the op multiplies bf16 pairs (AVX512_BF16) on a bf16 cache whose
        pages hold whole blocks of 16 (its decode reads K^T / V pairs without repacking);
        else `flat`."""
        if (
            dtype == torch.bfloat16
            and _op.has_bf16_dot()
            and page_size % 16 == 0
            and head_dim % 32 == 0
            and head_dim <= 256
        ):
            return "pairs16"
        return "flat"

    def __init__(self, kv_cache: KVCache) -> None:
        if kv_cache.k_buffers[0].device.type != "cpu":
            raise ValueError("attention_backend='cpu' needs the KV cache on the CPU")
        self.kv_cache = kv_cache
        self.op = _op
        self.kv_layout = KV_LAYOUTS.index(kv_cache.layout)  # the op's kv_layout argument
        head_dim = kv_cache.k_buffers[0].shape[2]
        # NOTE: the op's register tiles step 16 floats through the head dim.
        self._twin = TorchAttentionBackend(kv_cache) if head_dim % 16 else None
        if self._twin is not None:
            logger.warning(
                "CPU attention op needs head_dim %% 16 == 0 (got %d); using the torch backend",
                head_dim,
            )
        self._softcap_twin: TorchAttentionBackend | None = None
        self.force_num_kv_splits: int | None = None
        self.max_kv_splits = 16
        self.min_tokens_per_split = 256
        self.extend_block = 64
        # Decode rows sharing at least this many leading keys on the same pages attend to
        # them in one shared-prefix item (0: off).
        self.min_shared_tokens = 128
        # Extends of 2 .. this many rows as shared-prefix items of their own rows (`PlanConfig`):
        # on the pairs16 layout, where those take the one-read-per-block decode path.
        self.small_extend_rows = SMALL_EXTEND_ROWS if kv_cache.layout == "pairs16" else 0
        self._batch: ForwardBatch | None = None

    def init_forward(self, batch: ForwardBatch) -> None:
        """Plan the work items once per forward (shared by all layers; a sliding window's plan
        on its first layer): `plan.plan_work`."""
        self._batch = batch
        if self._twin is not None:
            self._twin.init_forward(batch)
            return
        self.page_table = batch.page_table.to(torch.int32).contiguous()
        self._plans: dict[int, WorkPlan] = {}
        self.plan = self._plan(0)  # full attention: what the one-call layer stack runs
        # Split-KV scratch, allocated by the first layer (Hq and D are known there).
        self._parts: tuple[torch.Tensor, torch.Tensor] | None = None

    def _plan(self, window: int) -> WorkPlan:
        """This forward's plan for layers with this sliding `window` (0: full attention)."""
        plan = self._plans.get(window)
        if plan is None:
            batch = self._batch
            assert batch is not None
            plan = self._plans[window] = plan_work(
                batch.extend_lens_cpu,
                batch.seq_lens_cpu,
                self.page_table,
                batch.page_size,
                PlanConfig(
                    threads=torch.get_num_threads(),
                    max_kv_splits=self.max_kv_splits,
                    min_tokens_per_split=self.min_tokens_per_split,
                    extend_block=self.extend_block,
                    force_num_kv_splits=self.force_num_kv_splits,
                    min_shared_tokens=self.min_shared_tokens,
                    window=window,
                    small_extend_rows=self.small_extend_rows,
                ),
            )
        return plan

    def _twin_backend(self) -> TorchAttentionBackend:
        """The torch twin (for this head dim, or a soft-capped layer), planned for this
        forward."""
        twin = self._twin or self._softcap_twin
        if twin is None:
            twin = self._softcap_twin = TorchAttentionBackend(self.kv_cache)
        if getattr(twin, "_batch", None) is not self._batch:
            twin.init_forward(self._batch)
        return twin

    @property
    def runs_compiled_op(self) -> bool:
        """False where this head dim sends every call to the torch twin."""
        return self._twin is None

    def partial_buffers(
        self, hq: int, d: int, num_parts: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's split-KV scratch (`[>= parts, Hq, D]`, `[>= parts, Hq]` fp32),
        allocated once per forward and shared by its layers."""
        need = self.plan.num_parts if num_parts is None else num_parts
        parts = self._parts
        if parts is None or parts[0].shape[1:] != (hq, d) or parts[0].shape[0] < need:
            parts = self._parts = (
                torch.empty((need, hq, d), dtype=torch.float32),
                torch.empty((need, hq), dtype=torch.float32),
            )
        return parts

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:  # [T, Hq, D]
        batch = self._batch
        assert batch is not None, "init_forward() must be called before forward()"
        if self._twin is not None or softcap:  # NOTE: soft-capping: the torch twin only
            return self._twin_backend().forward(layer_id, q, k, v, scale, window, softcap)
        plan = self._plan(window)
        k_buf = self.kv_cache.k_buffers[layer_id]
        v_buf = self.kv_cache.v_buffers[layer_id]
        store_kv(k_buf, v_buf, batch.out_cache_loc, k, v, self.kv_layout)
        qc = q if q.dtype == k_buf.dtype and q.stride(-1) == 1 else q.to(k_buf.dtype).contiguous()
        out = torch.empty(qc.shape, dtype=qc.dtype)  # [T, Hq, D]
        parts = self.partial_buffers(qc.shape[1], qc.shape[2], plan.num_parts)
        self.op.paged_attention(
            qc,
            k_buf,
            v_buf,
            out,
            self.page_table,
            plan.items,
            plan.item_rows,
            plan.reduces,
            parts[0],
            parts[1],
            batch.page_size,
            scale,
            window,
            self.kv_layout,
        )
        return out if out.dtype == q.dtype else out.to(q.dtype)
