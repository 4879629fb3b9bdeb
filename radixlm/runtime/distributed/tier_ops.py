"""The second KV tier across tensor-parallel ranks: rank 0 decides, every rank moves its shard.

Each rank holds its own KV heads of every pool page, so each keeps its own shard of every tier
page (``TierShard``: its store under ``<storage>/<identity>/rank<r>/`` and its page codec).
Rank 0's ``HiCache`` owns the tier's state; ``BroadcastTierFollowers`` (rank 0) sends each of
its decisions to the other ranks as a step op on the control broadcast, in order with the
forwards, so a page is read before a later forward overwrites it and written before the forward
that reads it:

    header  int64[8]  (op, n, 0, ..., payload length)
    payload int64[m]  OP_TIER_OPEN: the ``TierSpec`` as JSON bytes (n of them)
                      OP_TIER_STORE / OP_TIER_LOAD: n page ids, then n 16-byte keys
                      OP_TIER_FETCH / OP_TIER_DROP / OP_TIER_RETAIN: n keys
                      OP_TIER_CLEAR: none

``OP_TIER_LOAD`` is the one op with a reply: every rank contributes how many leading pages it
wrote (a missing or corrupt shard stops it) to an all-reduce MIN over the control group, so
rank 0 serves only the pages whole on every rank. A worker whose tier op fails logs it and
carries on (a failed load reports 0 pages): the tier never breaks the group.

Reads overlap the forward on every rank: ``OP_TIER_FETCH`` (sent when rank 0 starts its own
background read of a waiting request's pages) makes each worker read and verify its shards of
those keys on its shard's reader thread while the following forwards run; the ``OP_TIER_LOAD``
that adopts them takes that read's payloads (waiting for it if it is still running) and reads
only the keys it lacks (``TierShard.fetch`` / ``load``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from radixlm.radix import TierShard
from radixlm.radix.tier import KEY_BYTES
from radixlm.runtime.hicache_io import TierSpec, open_tier_shard

logger = logging.getLogger(__name__)

OP_TIER_OPEN = 10
OP_TIER_STORE = 11
OP_TIER_LOAD = 12
OP_TIER_DROP = 13
OP_TIER_RETAIN = 14
OP_TIER_CLEAR = 15
OP_TIER_FETCH = 16
TIER_OPS = frozenset(range(OP_TIER_OPEN, OP_TIER_FETCH + 1))


def pack_bytes(data: bytes) -> torch.Tensor:
    """Bytes as an int64 tensor (zero-padded to a multiple of 8)."""
    pad = -len(data) % 8
    return torch.from_numpy(np.frombuffer(data + b"\0" * pad, dtype=np.int64).copy())


def unpack_bytes(t: torch.Tensor, n: int) -> bytes:
    return t.numpy().tobytes()[:n]


def pack_pages_keys(pages: Sequence[int], keys: Sequence[bytes]) -> torch.Tensor:
    """[n page ids | n keys (KEY_BYTES // 8 int64 each)]."""
    return torch.cat([torch.tensor(list(pages), dtype=torch.int64), pack_bytes(b"".join(keys))])


def unpack_keys(t: torch.Tensor, n: int) -> list[bytes]:
    raw = unpack_bytes(t, n * KEY_BYTES)
    return [raw[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(n)]


def unpack_pages_keys(t: torch.Tensor, n: int) -> tuple[list[int], list[bytes]]:
    return t[:n].tolist(), unpack_keys(t[n:], n)


class OpSender(Protocol):
    """Rank 0's side of the step broadcast (``TensorParallelRunner.send_op``)."""

    def send_op(
        self, op: int, n: int, payload: torch.Tensor | None, reply: int | None = None
    ) -> int: ...


class BroadcastTierFollowers:
    """Rank 0's ``TierFollowers``: every call is one op replayed on ranks 1..N-1."""

    def __init__(self, runner: OpSender, spec: TierSpec) -> None:
        self.runner = runner
        data = spec.to_json()
        runner.send_op(OP_TIER_OPEN, len(data), pack_bytes(data))

    def store(self, keys: Sequence[bytes], pages: Sequence[int]) -> None:
        if keys:
            self.runner.send_op(OP_TIER_STORE, len(keys), pack_pages_keys(pages, keys))

    def fetch(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.runner.send_op(OP_TIER_FETCH, len(keys), pack_bytes(b"".join(keys)))

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        if not keys:
            return 0
        payload = pack_pages_keys(pages, keys)
        return self.runner.send_op(OP_TIER_LOAD, len(keys), payload, reply=len(keys))

    def drop(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.runner.send_op(OP_TIER_DROP, len(keys), pack_bytes(b"".join(keys)))

    def retain(self, keys: Sequence[bytes]) -> None:
        self.runner.send_op(OP_TIER_RETAIN, len(keys), pack_bytes(b"".join(keys)))

    def clear(self) -> None:
        self.runner.send_op(OP_TIER_CLEAR, 0, None)


class WorkerTier:
    """A worker rank's side: its ``TierShard`` (opened by ``OP_TIER_OPEN``) and the ops."""

    def __init__(self, rank: int, model_dir: Path) -> None:
        self.rank = rank
        self.model_dir = model_dir
        self.shard: TierShard | None = None

    def serve(self, op: int, n: int, payload: torch.Tensor, kv: Any, group: Any) -> None:
        """Apply one tier op to this rank's shard (``kv``: this rank's KV cache)."""
        if op == OP_TIER_LOAD:
            loaded = 0
            try:
                pages, keys = unpack_pages_keys(payload, n)
                loaded = self._shard().load(keys, pages)  # claims the op's background read
            except Exception:  # noqa: BLE001 - the page is recomputed, the group goes on
                logger.exception("hicache: rank %d failed to load tier pages", self.rank)
            reply = torch.tensor([loaded], dtype=torch.int64)
            dist.all_reduce(reply, op=dist.ReduceOp.MIN, group=group)
            return
        try:
            if op == OP_TIER_OPEN:
                spec = TierSpec.from_json(unpack_bytes(payload, n))
                self.shard = open_tier_shard(spec, kv, self.model_dir, self.rank)
            elif op == OP_TIER_FETCH:
                self._shard().fetch(unpack_keys(payload, n))
            elif op == OP_TIER_STORE:
                pages, keys = unpack_pages_keys(payload, n)
                self._shard().store(keys, pages)
            elif op == OP_TIER_DROP:
                self._shard().drop(unpack_keys(payload, n))
            elif op == OP_TIER_RETAIN:
                self._shard().retain(unpack_keys(payload, n))
            elif op == OP_TIER_CLEAR:
                self._shard().clear()
        except Exception:  # noqa: BLE001 - the tier is an optimization: never break the group
            logger.exception("hicache: rank %d failed tier op %d", self.rank, op)

    def _shard(self) -> TierShard:
        if self.shard is None:
            raise RuntimeError("tier op before OP_TIER_OPEN")
        return self.shard

    def close(self) -> None:
        if self.shard is not None:
            self.shard.close()
