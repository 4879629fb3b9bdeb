"""`TritonAttentionBackend` ("triton"): the GPU attention path, same interface as the torch twin.

Per forward, `init_forward` plans once for all layers: the paged index is the batch's page table
itself (`kv_indptr[r] = r * max_pages`, `kv_indices = page_table` flattened: no gather, no device
sync), the requests are split into decode rows (one new token: the decode kernel, GQA-grouped,
split-KV when few requests have long contexts) and extend rows (several new tokens: the extend
kernel), and the split-KV scratch is allocated. Per layer, `forward` stores the new K/V into
their slots and runs the one or two attention launches.

Imported only when the backend is created (see `radixlm.kernels.registry`); it imports triton.
"""

from __future__ import annotations

import torch

from radixlm.kernels.attention import interpret_mode, page_table_indptr
from radixlm.kernels.decode_attention import (
    _decode_stage1_kernel,
    decode_attention,
    decode_mid_buffers,
)
from radixlm.kernels.extend_attention import extend_attention
from radixlm.kernels.forward_batch import ForwardBatch, KVCache
from radixlm.kernels.kv_store import store_kv
from radixlm.kernels.registry import register_attention_backend
from radixlm.kernels.split_kv import num_kv_splits


def choose_num_kv_splits(
    num_decode: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    max_splits: int = 16,
    min_tokens_per_split: int = 256,
) -> int:
    """Split-KV factor for a decode launch: one program per (decode row, KV head), ~2 per SM
    wanted (`radixlm.kernels.split_kv`)."""
    if num_decode == 0:
        return 1
    return num_kv_splits(
        num_decode * num_kv_heads, 2 * num_sms, max_seq_len, max_splits, min_tokens_per_split
    )


def _check_interpreted() -> None:
    """CPU tensors need kernels decorated in interpreter mode (decided at import time)."""
    from triton.runtime.interpreter import InterpretedFunction

    if not interpret_mode() or not isinstance(_decode_stage1_kernel, InterpretedFunction):
        raise RuntimeError(
            "attention_backend='triton' on CPU needs TRITON_INTERPRET=1 set before radixlm's "
            "Triton kernels are imported (it is a slow test mode; use 'torch' on CPU)"
        )


@register_attention_backend("triton")
class TritonAttentionBackend:
    """Triton paged attention over a `KVCache`.

    `force_num_kv_splits` overrides the split-KV heuristic (tests, benchmarks);
    `max_kv_splits` / `min_tokens_per_split` tune it.
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        device = kv_cache.k_buffers[0].device
        if device.type == "cpu":
            _check_interpreted()
            self.num_sms = 1
        else:
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.force_num_kv_splits: int | None = None
        self.max_kv_splits = 16
        self.min_tokens_per_split = 256
        self._batch: ForwardBatch | None = None

    def init_forward(self, batch: ForwardBatch) -> None:
        """Plan once per forward (shared by all layers).

        Every launch reads only device tensors of `batch` and of this plan (no host copy of a
        length enters a kernel), so a decode-only forward is capturable in a CUDA graph: the
        host lists decide only which kernels run, their grids and the split-KV factor (a
        graph's capture batch claims the longest context it serves)."""
        device = batch.page_table.device
        self._batch = batch
        self.kv_indptr = page_table_indptr(batch.page_table)  # [B + 1] int32
        self.kv_indices = batch.page_table.reshape(-1)  # [B * max_pages] int32
        lens = batch.extend_lens_cpu
        decode = [i for i, e in enumerate(lens) if e == 1]
        extend = [i for i, e in enumerate(lens) if e > 1]
        if len(decode) == len(lens):
            self.decode_ids = torch.arange(len(lens), dtype=torch.int32, device=device)
        else:
            self.decode_ids = _index_tensor(decode, device)
        self.extend_ids = _index_tensor(extend, device)
        self.max_extend_len = max((lens[i] for i in extend), default=0)
        self.q_rows = batch.qo_indptr[:-1]  # [B] row of each request's first new token
        if self.force_num_kv_splits is not None:
            splits = self.force_num_kv_splits
        else:
            splits = choose_num_kv_splits(
                len(decode),
                self.kv_cache.k_buffers[0].shape[1],
                max((batch.seq_lens_cpu[i] for i in decode), default=0),
                self.num_sms,
                self.max_kv_splits,
                self.min_tokens_per_split,
            )
        self.num_kv_splits = splits
        # Split-KV scratch, allocated by the first layer that needs it (Hq is known there) and
        # reused by the others.
        self.mid: tuple[torch.Tensor, torch.Tensor] | None = None

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
        if softcap:
            raise NotImplementedError("attention soft-capping: use attention_backend='torch'")
        k_buf = self.kv_cache.k_buffers[layer_id]
        v_buf = self.kv_cache.v_buffers[layer_id]
        store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        o = torch.empty_like(q)
        if self.decode_ids.numel():
            mid = self.mid
            if self.num_kv_splits > 1 and (mid is None or mid[0].shape[1] != q.shape[1]):
                mid = self.mid = decode_mid_buffers(
                    self.decode_ids.numel(), q.shape[1], q.shape[2], self.num_kv_splits, q
                )
            decode_attention(
                q,
                k_buf,
                v_buf,
                o,
                self.decode_ids,
                self.q_rows,
                batch.seq_lens,
                self.kv_indptr,
                self.kv_indices,
                batch.page_size,
                scale,
                self.num_kv_splits,
                mid,
                window,
            )
        if self.extend_ids.numel():
            extend_attention(
                q,
                k,
                v,
                o,
                k_buf,
                v_buf,
                self.extend_ids,
                batch.qo_indptr,
                batch.prefix_lens,
                self.kv_indptr,
                self.kv_indices,
                batch.page_size,
                scale,
                self.max_extend_len,
                window,
            )
        return o


def _index_tensor(idx: list[int], device: torch.device) -> torch.Tensor:
    if not idx:  # NOTE: no host copy at all (a CUDA graph capture refuses one)
        return torch.empty(0, dtype=torch.int32, device=device)
    return torch.tensor(idx, dtype=torch.int32).to(device, non_blocking=True)
