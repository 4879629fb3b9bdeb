"""KV buffers and attention for a hybrid pool: full-attention layers over the full pages,
sliding-window layers over their own, smaller set of window pages (SGLang's SWA memory pool).

`HybridKVCache` holds two `KVCache`s with one entry per layer each; a layer's buffers are empty
(`[0, Hkv, D]`) in the cache it does not use. `swa_map` `[num_pages]` int32 maps a full page
id to its window page id (the window pool's last page, a zero scratch page, when released); it
is the page pool's (`radixlm.radix.HybridBlockPool.swa_map`), read zero-copy, never written here.

`HybridAttention` is an attention backend over it: one backend instance per cache, each planned
per forward with its own `ForwardBatch` (the window one's page table and K/V slots translated
through `swa_map`), and each layer routed to its cache's backend. The backends themselves are
unchanged: a window layer reads only its window's keys, so a released page (the scratch page)
is never read by the compiled CPU op or the Triton kernels, and the torch twin masks it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from radixlm.kernels.forward_batch import ForwardBatch, KVCache
from radixlm.kernels.registry import create_attention_backend


@dataclass
class HybridKVCache:
    full: KVCache  # full-attention layers; window layers' buffers empty
    windowed: KVCache  # window layers over `num_swa_pages + 1` pages; full layers' empty
    window_layers: frozenset[int]
    swa_map: torch.Tensor | None = None  # [num_pages] int32, host; bound by `bind_swa_map`

    @classmethod
    def allocate(
        cls,
        windows: list[int],
        num_pages: int,
        num_swa_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layout: str = "flat",
    ) -> HybridKVCache:
        """`windows[l]` > 0 marks layer `l` as a window layer; both caches in `layout`."""
        win = frozenset(i for i, w in enumerate(windows) if w > 0)
        full_layers = frozenset(range(len(windows))) - win
        geometry = (num_kv_heads, head_dim, dtype, device, layout)
        # NOTE: one extra window page, the scratch page that released pages map to.
        return cls(
            full=KVCache.allocate(len(windows), num_pages, page_size, *geometry, full_layers),
            windowed=KVCache.allocate(len(windows), num_swa_pages + 1, page_size, *geometry, win),
            window_layers=win,
        )

    @staticmethod
    def bytes_per_page(
        windows: list[int], page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> tuple[int, int]:
        """(bytes of one full page, of one window page): the K/V of their layers."""
        n_win = sum(1 for w in windows if w > 0)
        per_layer = KVCache.bytes_per_page(1, page_size, num_kv_heads, head_dim, dtype)
        return (len(windows) - n_win) * per_layer, n_win * per_layer

    @property
    def layout(self) -> str:
        """Both caches' KV layout (`forward_batch.KV_LAYOUTS`)."""
        return self.full.layout

    def bind_swa_map(self, swa_map: torch.Tensor) -> None:
        self.swa_map = swa_map

    def window_pages(self, pages: torch.Tensor, swa_map: torch.Tensor | None = None):
        """Full page ids -> window page ids, same shape, int32, on the pages' device
        (`swa_map`: the map already on that device)."""
        if swa_map is None:
            assert self.swa_map is not None, "bind_swa_map() before the first forward"
            swa_map = self.swa_map.to(pages.device, non_blocking=True)
        return swa_map[pages.long()]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages: the full layers', and the window layers' through `swa_map`."""
        if not src:
            return
        self.full.copy_pages(src, dst)
        to_window = self.window_pages(torch.tensor(src + dst, dtype=torch.int32)).tolist()
        self.windowed.copy_pages(to_window[: len(src)], to_window[len(src) :])


class HybridAttention:
    """An attention backend (`init_forward`, `forward`) over a `HybridKVCache`: `name`'s
    backend once for the full layers, once for the window layers."""

    def __init__(self, name: str, kv_cache: HybridKVCache) -> None:
        self.kv_cache = kv_cache
        self.full = create_attention_backend(name, kv_cache.full)
        self.windowed = create_attention_backend(name, kv_cache.windowed)
        self.window_layers = kv_cache.window_layers

    def init_forward(self, batch: ForwardBatch) -> None:
        self.full.init_forward(batch)
        self.windowed.init_forward(self.window_batch(batch))

    def window_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """The window layers' view of `batch`: page table and K/V slots in window pages."""
        ps, kv = batch.page_size, self.kv_cache
        assert kv.swa_map is not None, "bind_swa_map() before the first forward"
        swa_map = kv.swa_map.to(batch.page_table.device, non_blocking=True)  # [num_pages] int32
        table = kv.window_pages(batch.page_table, swa_map)  # [B, P] int32
        loc = batch.out_cache_loc  # [T] int64
        slots = kv.window_pages(loc // ps, swa_map).to(torch.int64) * ps + loc % ps  # [T]
        return replace(batch, page_table=table.contiguous(), out_cache_loc=slots)

    def forward(self, layer_id: int, *args, **kwargs) -> torch.Tensor:
        backend = self.windowed if layer_id in self.window_layers else self.full
        return backend.forward(layer_id, *args, **kwargs)
