"""A tensor-parallel worker's tier ops (``WorkerTier``) in process: ``OP_TIER_FETCH`` reads the
rank's shards on its reader thread, the ``OP_TIER_LOAD`` that follows takes those payloads (and
reads only what the read lacked), unclaimed reads are bounded, and the reply is the pages every
page of which this rank wrote. The group's all-reduce is stubbed; the multi-process path is
``tests/runtime/test_hicache_engine.py``'s TP=2 tests."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from radixlm.radix import BlockPool, HiCache, HostTierStore, RadixCache, TierShard
from radixlm.radix.tier import page_keys
from radixlm.runtime.distributed import tier_ops
from radixlm.runtime.distributed.tier_ops import (
    OP_TIER_CLEAR,
    OP_TIER_FETCH,
    OP_TIER_LOAD,
    WorkerTier,
    pack_bytes,
    pack_pages_keys,
)

PS = 4


class PoolIO:
    """Pages as bytes in a dict (``page_bytes``: reads go into the shard's buffers)."""

    page_bytes = 8

    def __init__(self) -> None:
        self.pages: dict[int, bytes] = {}

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        return [self.pages[p] for p in pages]

    def write_pages(self, pages: Sequence[int], payloads: Sequence[bytes]) -> None:
        for p, payload in zip(pages, payloads, strict=True):
            self.pages[p] = bytes(payload)


class ThreadLog(HostTierStore):
    """A host store that records the thread of every read and can hold reads at a gate."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.reads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def get(self, key: bytes, into: memoryview | None = None) -> bytes | None:
        self.gate.wait(10)
        self.reads.append(threading.current_thread().name)
        return super().get(key, into)


@pytest.fixture
def worker(monkeypatch) -> tuple[WorkerTier, ThreadLog, PoolIO, list[int]]:
    replies: list[int] = []
    monkeypatch.setattr(
        tier_ops.dist, "all_reduce", lambda t, op=None, group=None: replies.append(int(t[0]))
    )
    store, io = ThreadLog(), PoolIO()
    tier = WorkerTier(1, model_dir=None)  # type: ignore[arg-type]
    tier.shard = TierShard(store, io)
    yield tier, store, io, replies
    tier.close()


def keys_for(tokens: list[int]) -> list[bytes]:
    return list(page_keys(tokens, PS))


def fill(store: ThreadLog, keys: list[bytes]) -> None:
    for i, key in enumerate(keys):
        store.put(key, bytes([i]) * PoolIO.page_bytes)


def serve_fetch(tier: WorkerTier, keys: list[bytes]) -> None:
    tier.serve(OP_TIER_FETCH, len(keys), pack_bytes(b"".join(keys)), None, None)


def serve_load(tier: WorkerTier, keys: list[bytes], pages: list[int]) -> None:
    tier.serve(OP_TIER_LOAD, len(keys), pack_pages_keys(pages, keys), None, None)


def test_a_load_takes_the_background_read(worker) -> None:
    tier, store, io, replies = worker
    keys = keys_for(list(range(16)))
    fill(store, keys)
    store.gate.clear()  # the read is in flight while the load op arrives
    serve_fetch(tier, keys)
    threading.Timer(0.05, store.gate.set).start()
    serve_load(tier, keys, [7, 3, 9, 1])
    assert replies == [4]
    assert [io.pages[p] for p in (7, 3, 9, 1)] == [bytes([i]) * 8 for i in range(4)]
    assert tier.shard.prefetched_pages == 4
    assert len(store.reads) == 4 and all(n.startswith("hicache-shard") for n in store.reads)


def test_a_load_without_a_read_or_past_it_reads_itself(worker) -> None:
    tier, store, io, replies = worker
    keys = keys_for(list(range(16)))
    fill(store, keys)
    serve_load(tier, keys[:2], [0, 1])  # no read started: synchronous
    assert replies == [2] and tier.shard.prefetched_pages == 0
    serve_fetch(tier, keys[:2])  # a read of the first two; the load wants all four
    serve_load(tier, keys, [4, 5, 6, 7])
    assert replies == [2, 4] and tier.shard.prefetched_pages == 2
    assert [io.pages[p][0] for p in (4, 5, 6, 7)] == [0, 1, 2, 3]
    main = threading.current_thread().name
    assert store.reads.count(main) == 2 + 2  # the first load's two, the second's last two


def test_a_missing_shard_stops_the_load_and_the_reply_says_where(worker) -> None:
    tier, store, io, replies = worker
    keys = keys_for(list(range(16)))
    fill(store, keys)
    store.drop(keys[2])
    serve_fetch(tier, keys)
    serve_load(tier, keys, [0, 1, 2, 3])
    assert replies == [2] and set(io.pages) == {0, 1}


def test_unclaimed_reads_are_bounded_and_cleared(worker) -> None:
    tier, store, _, replies = worker
    bound = TierShard.MAX_UNCLAIMED_READS
    convs = [keys_for([100 * c + j for j in range(8)]) for c in range(bound + 2)]
    for keys in convs:
        fill(store, keys)
        serve_fetch(tier, keys)
    assert len(tier.shard._reads) == bound  # the two oldest forgotten
    serve_load(tier, convs[0], [0, 1])  # forgotten: read again, still right
    assert replies == [2] and tier.shard.prefetched_pages == 0
    serve_load(tier, convs[-1], [2, 3])
    assert replies == [2, 2] and tier.shard.prefetched_pages == 2
    tier.serve(OP_TIER_CLEAR, 0, torch.empty(0, dtype=torch.int64), None, None)
    assert not tier.shard._reads


def test_rank0_starts_the_followers_reads_with_the_keys_it_will_load() -> None:
    """``HiCache.fetch_keys`` sends the followers the keys its own read covers, and the load
    afterwards asks them for the same keys (so a worker's read is claimed)."""
    calls: list[tuple[str, list[bytes]]] = []

    class Followers:
        def fetch(self, keys: Sequence[bytes]) -> None:
            calls.append(("fetch", list(keys)))

        def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
            calls.append(("load", list(keys)))
            return len(pages)

        def store(self, keys, pages) -> None: ...
        def drop(self, keys) -> None: ...
        def retain(self, keys) -> None: ...
        def clear(self) -> None: ...

    io = PoolIO()
    pool = BlockPool(16, PS)
    hc = HiCache(RadixCache(pool), HostTierStore(1 << 20), io, followers=Followers())
    tokens = list(range(13))
    for i, key in enumerate(page_keys(tokens, PS)):
        hc.store.put(key, bytes([i]) * 8)
    keys = hc.fetch_keys(tokens, None, PS)  # the pool holds the first page
    assert keys == list(page_keys(tokens, PS))[1:] and calls == [("fetch", keys)]
    pages = hc.load(tokens, None, PS, prefetched=hc.read(keys))
    assert len(pages) == 2 and calls[-1] == ("load", keys)
    assert [io.pages[p][0] for p in pages] == [1, 2]
    pool.decref(pages)
