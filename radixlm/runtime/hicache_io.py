"""The runtime side of the second KV tier: the page codec over the pool's KV buffers, the
store's identity, and building a ``HiCache`` from the engine's config.

A page payload is the raw bytes of ``[2 * num_layers, page_size, num_kv_heads, head_dim]`` in
the cache dtype: every layer's K rows of the page, then every layer's V rows. The identity
(``kv_identity``) names everything that makes such bytes meaningful; a tier written under
another identity is never read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.config import CacheConfig
from radixlm.kernels.forward_batch import KVCache
from radixlm.radix import (
    HiCache,
    HostTierStore,
    RadixCache,
    TierShard,
    TierStore,
    open_file_store,
)

logger = logging.getLogger(__name__)

GB = 1024**3
# a GPU pool's loads: host-to-device copies of this many bytes overlap filling the next ones
UPLOAD_CHUNK_BYTES = 64 << 20
# files of a model directory that decide what its K/V are (weights, config, tokenizer)
_MODEL_FILE_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json", ".model", ".txt")


class KVPageIO:
    """Whole pool pages <-> payload bytes (``PageIO``), on any device (via host memory).

    Loads go through one host staging buffer kept across calls (grown to the largest call,
    faulted in once): a fresh 46 MB host tensor per 2048-token load cost more in page faults
    than the copies themselves (41 vs ~11 ms measured). NOTE: one caller at a time (the
    engine's loop thread, or a tensor-parallel worker's own loop).
    """

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        buf = kv.k_buffers[0]
        self.device = buf.device
        self.dtype = buf.dtype
        # [2 * L, page_size, Hkv, D] per page
        self.page_shape = (2 * len(kv.k_buffers), self.page_size, *buf.shape[1:])
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._uploaded: torch.cuda.Event | None = None  # a GPU pool's last staged upload

    def _stage(self, num_pages: int) -> torch.Tensor:
        """The staging buffer's first ``num_pages`` pages, ``[P, 2L, page_size, Hkv, D]``."""
        nbytes = num_pages * self.page_bytes
        if self._staging.numel() < nbytes:
            # NOTE: pinned for a GPU pool: the host-to-device copy then runs at the link's speed
            # (pageable memory is copied through a driver bounce buffer first).
            pin = self.device.type == "cuda"
            self._staging = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
        return self._staging[:nbytes].view(self.dtype).view(num_pages, *self.page_shape)

    @property
    def page_bytes(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def _paged(self) -> list[torch.Tensor]:
        """Every layer's K then V buffer viewed as ``[num_pages, page_size, Hkv, D]``."""
        ps = self.page_size
        return [b.view(-1, ps, *b.shape[1:]) for b in (*self.kv.k_buffers, *self.kv.v_buffers)]

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        """The pages' payloads: views of one host buffer made for the call (one copy, where
        a bytes object per page cost a second copy into fresh memory: 35 vs ~16 ms for 128
        pages). The buffer lives while any of its views does; a store that keeps payloads long
        copies them."""
        if not pages:
            return []
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        host = torch.empty(len(pages) * self.page_bytes, dtype=torch.uint8)
        out = host.view(self.dtype).view(len(pages), *self.page_shape)
        dev = out if self.device.type == "cpu" else torch.empty_like(out, device=self.device)
        for i, buf in enumerate(self._paged()):
            dev[:, i] = buf.index_select(0, idx)  # [P, ps, H, D]
        if dev is not out:
            out.copy_(dev)
        raw = host.numpy().reshape(len(pages), -1)  # [P, page bytes]
        return [memoryview(row) for row in raw]  # type: ignore[misc]

    def write_pages(self, pages: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Two copies: the payloads into one host tensor, then each buffer's rows in place."""
        if not pages:
            return
        pb = self.page_bytes
        for p in payloads:
            if len(p) != pb:
                raise ValueError(f"page payload of {len(p)} bytes, expected {pb}")
        if self.device.type == "cuda":
            data = self._upload(payloads)
        else:
            host = self._stage(len(pages))
            arr = host.view(torch.uint8).reshape(-1).numpy()
            for i, p in enumerate(payloads):
                arr[i * pb : (i + 1) * pb] = np.frombuffer(p, np.uint8)
            data = host
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        for i, buf in enumerate(self._paged()):
            buf.index_copy_(0, idx, data[:, i])  # [P, ps, H, D] strided source

    def _upload(self, payloads: Sequence[bytes]) -> torch.Tensor:  # [P, 2L, ps, Hkv, D]
        """A GPU pool's load: the payloads copied into the pinned staging buffer in chunks of
        `UPLOAD_CHUNK_BYTES` (torch's parallel copy), each chunk's host-to-device copy running
        while the next is filled. The staging buffer is refilled only after the previous
        load's copies have finished (`_uploaded`)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        n, pb = len(payloads), self.page_bytes
        flat = self._stage(n).view(-1).view(torch.uint8).view(n, pb)
        dev = torch.empty((n, pb), dtype=torch.uint8, device=self.device)
        step = max(1, UPLOAD_CHUNK_BYTES // pb)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NOTE: read-only payloads are only read
            for s in range(0, n, step):
                e = min(n, s + step)
                for i in range(s, e):
                    flat[i].copy_(torch.frombuffer(payloads[i], dtype=torch.uint8))
                dev[s:e].copy_(flat[s:e], non_blocking=True)
        self._uploaded = torch.cuda.Event()
        self._uploaded.record()
        return dev.view(self.dtype).view(n, *self.page_shape)


def _files_identity(directory: Path) -> list[tuple[str, int, int]]:
    out = []
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name.endswith(_MODEL_FILE_SUFFIXES):
            st = path.stat()
            out.append((path.name, st.st_size, int(st.st_mtime)))
    return out


def tokenizer_id(tokenizer: Any) -> str:
    """The tokenizer's part of the identity (class, vocabulary size)."""
    return f"{type(tokenizer).__name__}:{len(tokenizer)}"


def kv_identity(
    model_dir: Path, kv: KVCache, tokenizer: str, tp_size: int = 1
) -> dict[str, object]:
    """What tier pages are valid for: the model files (path, names, sizes, mtimes), the cache
    dtype, page size, KV layout (this rank's shard of it), the tokenizer (``tokenizer_id``) and
    the tensor-parallel size; the same on every rank."""
    buf = kv.k_buffers[0]
    directory = model_dir if model_dir.is_dir() else model_dir.parent
    return {
        "model_path": str(model_dir.resolve()),
        "model_files": _files_identity(directory),
        "dtype": str(buf.dtype),
        "page_size": kv.page_size,
        "num_layers": len(kv.k_buffers),
        "num_kv_heads": int(buf.shape[1]),
        "head_dim": int(buf.shape[2]),
        "kv_layout": kv.layout,
        "tokenizer": tokenizer,
        "tp_size": tp_size,
    }


@dataclass(frozen=True)
class TierSpec:
    """Where and how big each rank's tier is (crosses to the tensor-parallel ranks as JSON)."""

    storage_dir: str | None  # None: host memory
    capacity_bytes: int
    tokenizer: str  # ``tokenizer_id``: the worker ranks load no tokenizer
    tp_size: int = 1

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> TierSpec:
        return cls(**json.loads(data))


def open_tier_shard(spec: TierSpec, kv: KVCache, model_dir: Path, rank: int = 0) -> TierShard:
    """Rank ``rank``'s shard of the tier: a host store, or its file store under the storage
    dir (``<identity>/rank<r>/``, re-indexed: a warm restart finds this rank's shards)."""
    if spec.storage_dir is None:
        store: TierStore = HostTierStore(spec.capacity_bytes)
    else:
        identity = kv_identity(model_dir, kv, spec.tokenizer, spec.tp_size)
        store = open_file_store(spec.storage_dir, identity, spec.capacity_bytes, rank=rank)
    return TierShard(store, KVPageIO(kv))


def make_hicache(
    config: CacheConfig,
    cache: RadixCache,
    runner: Any,
    model_dir: Path,
    tokenizer: Any,
) -> HiCache | None:
    """The second tier, or None when it is off. With tensor parallel (``runner.tp_size > 1``)
    the other ranks open their shards (``runner.open_tier``) and follow rank 0's."""
    if not config.hicache_enabled:
        if config.enable_hierarchical_cache or config.hicache_storage_dir is not None:
            logger.warning("hicache: the second KV tier needs the prefix cache; it stays off")
        return None
    tp_size = int(getattr(runner, "tp_size", 1))
    spec = TierSpec(
        config.hicache_storage_dir, int(config.hicache_size * GB), tokenizer_id(tokenizer), tp_size
    )
    shard = open_tier_shard(spec, runner.kv_cache, model_dir)
    store, io = shard.tier_store, shard.io
    where = "host" if spec.storage_dir is None else str(getattr(store, "directory", ""))
    followers = runner.open_tier(spec) if tp_size > 1 else None
    logger.info(
        "hicache: second KV tier in %s, %.2f GB (%d pages of %.1f KB per rank, %d ranks), %s",
        where, config.hicache_size, spec.capacity_bytes // io.page_bytes, io.page_bytes / 1024,
        tp_size, config.hicache_write_policy,
    )  # fmt: skip
    write_through = config.hicache_write_policy == "write_through"
    return HiCache(cache, store, io, where, write_through, followers)
