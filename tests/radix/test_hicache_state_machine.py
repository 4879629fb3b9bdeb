"""Stateful property test: RadixCache + BlockPool + the second tier (``HiCache``).

Every pool page has simulated contents (what the forward would have written): a page computed
for a prefix holds that prefix's page key. The tier stores and loads those contents through a
fake ``PageIO``. After every step: the pool and tree integrity checks, the tier's, and the one
that matters: **every tree page holds the contents of its own prefix**, whether it was
computed, kept in the pool or loaded back from the tier (a wrong, stale, corrupt or foreign
page would break it). A tiny alphabet makes prefixes collide; a small pool and tier make
eviction and the tier's LRU run constantly. The file-backed store also gets restarts (a new
store over the same directory) and corrupted files.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.radix import BlockPool, FileTierStore, HiCache, HostTierStore, RadixCache, TierShard
from radixlm.radix.tier import identity_digest, page_keys

NAMESPACES = [None, "lora-a"]
namespaces = st.sampled_from(NAMESPACES)
token_lists = st.lists(st.integers(0, 1), min_size=1, max_size=12)
ID = identity_digest({"test": "hicache"})


class FakeIO:
    """Pool page contents as bytes (the page key of the prefix it was computed for). With
    `page_bytes` (rank 0's: every payload is a 16-byte key) `HiCache.fetch` reads page files into
    its reused buffers, so a payload must be copied on write (a kept view would change)."""

    def __init__(self, num_pages: int, page_bytes: int | None = None) -> None:
        self.contents: list[bytes | None] = [None] * num_pages
        if page_bytes is not None:
            self.page_bytes = page_bytes

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        out = [self.contents[p] for p in pages]
        assert all(c is not None for c in out), "the tier read a page that was never written"
        return [c for c in out if c is not None]

    def write_pages(self, pages: Sequence[int], payloads: Sequence[bytes]) -> None:
        for p, c in zip(pages, payloads, strict=True):
            self.contents[p] = bytes(c)


@dataclass
class Req:
    ns: Hashable | None
    tokens: list[int]
    pages: list[int]


class HiCacheMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(4, 16),
        tier_pages=st.integers(1, 12),
        storage=st.sampled_from(["host", "file"]),
        write_through=st.booleans(),
        follower=st.booleans(),
    )
    def setup(
        self,
        page_size: int,
        num_pages: int,
        tier_pages: int,
        storage: str,
        write_through: bool,
        follower: bool,
    ) -> None:
        self.ps = page_size
        self.pool = BlockPool(num_pages, page_size)
        self.cache = RadixCache(self.pool)
        self.io = FakeIO(num_pages, page_bytes=16)
        self.capacity = tier_pages * 16  # a page's contents: a 16-byte key
        self.dir = tempfile.mkdtemp(prefix="hicache-sm-") if storage == "file" else None
        self.write_through = write_through
        # rank 1: its shard of a page computed for a prefix holds b"1" + that prefix's key
        self.io1 = FakeIO(num_pages)
        self.shard1 = TierShard(HostTierStore(self.capacity * 4), self.io1) if follower else None
        self.hicache = self._new_hicache()
        self.reqs: list[Req] = []
        self.known: set[bytes] = set()  # keys of every page ever computed
        self.corrupted: set[bytes] = set()  # keys whose file a rule damaged
        # background reads (``fetch``) not taken yet, possibly stale by the time they are
        self.prefetched: dict[tuple[Hashable | None, tuple[int, ...]], dict[bytes, bytes]] = {}

    def _new_hicache(self) -> HiCache:
        store = self._new_store()
        return HiCache(self.cache, store, self.io, self.dir or "", self.write_through, self.shard1)

    def _new_store(self) -> HostTierStore | FileTierStore:
        if self.dir is None:
            return HostTierStore(self.capacity)
        return FileTierStore(self.dir, self.capacity, ID, fsync=False)  # fast; no crash here

    def teardown(self) -> None:
        if hasattr(self, "hicache"):
            self.hicache.close()
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    def _start(self, tokens: list[int], ns: Hashable | None) -> Req | None:
        """Admission as the scheduler does it: pool match (locked), tier load, the rest
        allocated and "computed" (contents written), full pages inserted; None when the pool
        cannot hold it (everything it took released)."""
        m = self.cache.match_prefix(tokens, ns)
        self.cache.lock(m.node)
        pages = list(m.pages)
        prefetched = self.prefetched.pop((ns, tuple(tokens)), None)
        loaded = self.hicache.load(tokens, ns, m.num_tokens, prefetched=prefetched)
        pages += loaded
        keys = list(page_keys(tokens, self.ps, ns))
        if loaded:
            event("pages loaded from the tier")
        for i, p in enumerate(loaded, start=len(m.pages)):
            assert self.io.contents[p] == keys[i], "the tier loaded the wrong contents"
            if self.shard1 is not None:
                assert self.io1.contents[p] == b"1" + keys[i], "rank 1 loaded the wrong shard"
        need = -(-len(tokens) // self.ps) - len(pages)
        if need > self.pool.num_free:
            self.cache.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            self._cache_full(Req(ns, tokens, pages))
            self.pool.decref(pages)
            return None
        fresh = self.pool.alloc(need)
        for i, p in enumerate(fresh, start=len(pages)):
            self.io.contents[p] = keys[i] if i < len(keys) else b"partial"
            self.io1.contents[p] = b"1" + keys[i] if i < len(keys) else b"partial"
        pages += fresh
        self.known.update(keys)
        return Req(ns, tokens, pages)

    def _cache_full(self, req: Req) -> None:
        n = len(req.tokens) // self.ps
        n = min(n, len(req.pages))
        if n:
            tokens = req.tokens[: n * self.ps]
            req.pages[:n] = self.cache.insert_and_adopt(tokens, req.pages[:n], req.ns)
            if self.write_through:  # as PageManager.cache_computed does
                self.hicache.on_cached(req.ns, tokens, req.pages[:n])

    # ------------------------------------------------------------------ rules
    @rule(tokens=token_lists, ns=namespaces)
    def run_request(self, tokens: list[int], ns: Hashable | None) -> None:
        req = self._start(tokens, ns)
        if req is not None:
            self._cache_full(req)
            self.pool.decref(req.pages)

    @rule(tokens=token_lists, ns=namespaces)
    def start_request(self, tokens: list[int], ns: Hashable | None) -> None:
        req = self._start(tokens, ns)
        if req is not None:
            self._cache_full(req)  # its prefill chunks are cached as they complete
            self.reqs.append(req)

    @rule(tokens=token_lists, ns=namespaces)
    def prefetch(self, tokens: list[int], ns: Hashable | None) -> None:
        """A background read for a waiting request; the request runs later (other rules may
        evict, load, drop or flush in between)."""
        start = self.cache.peek_prefix_len(tokens, ns)
        got = self.hicache.fetch(tokens, ns, start)
        keys = list(page_keys(tokens, self.ps, ns))[start // self.ps :]
        assert list(got) == keys[: len(got)]
        self.prefetched[(ns, tuple(tokens))] = got
        if got:
            event("prefetched pages")

    @precondition(lambda self: self.prefetched)
    @rule(data=st.data())
    def run_prefetched(self, data: st.DataObject) -> None:
        """The request whose pages were read earlier is admitted now."""
        ns, tokens = data.draw(st.sampled_from(sorted(self.prefetched, key=repr)))
        self.run_request(list(tokens), ns)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.pool.decref(req.pages)

    @rule(k=st.integers(0, 8))
    def evict(self, k: int) -> None:
        before = self.hicache.stats().stored_pages
        self.cache.evict(k)
        assert self.hicache.stats().stored_pages >= before

    @rule(data=st.data())
    def drop_tier_page(self, data: st.DataObject) -> None:
        # the index only after the background writes: what is drawn from must not depend on
        # their timing (hypothesis replays a case and requires the same draws)
        self.hicache.store.wait_writes()
        keys = self.hicache.store.keys()
        if keys:
            self.hicache.store.drop(data.draw(st.sampled_from(keys)))

    @precondition(lambda self: self.shard1 is not None)
    @rule(data=st.data())
    def lose_follower_shard(self, data: st.DataObject) -> None:
        """Rank 1 lacks its shard of a page rank 0 holds: that page is never served."""
        assert self.shard1 is not None
        self.shard1.tier_store.wait_writes()  # as in drop_tier_page
        keys = self.shard1.tier_store.keys()
        if keys:
            self.shard1.tier_store.drop(data.draw(st.sampled_from(keys)))
            event("a follower lost a shard")

    @precondition(lambda self: not self.reqs)
    @rule()
    def flush(self) -> None:
        self.cache.reset()
        self.hicache.clear()
        event("flushed")
        assert self.pool.num_free == self.pool.num_pages
        assert self.hicache.stats().pages == 0
        assert self.shard1 is None or not self.shard1.tier_store.keys()

    @rule()
    def write_back_all(self) -> None:
        self.hicache.write_back_all()

    @precondition(lambda self: self.dir is not None)
    @rule()
    def restart_store(self) -> None:
        """A new store over the same directory (a restarted server) under the same tree."""
        self.hicache.close()
        before = set(self.hicache.store.keys())
        self.hicache = self._new_hicache()
        after = set(self.hicache.store.keys())
        assert before - self.corrupted <= after <= before  # a damaged header is dropped
        if self.shard1 is not None:  # the follower keeps only what rank 0's index holds
            assert set(self.shard1.tier_store.keys()) <= after
        self.corrupted &= after

    @precondition(lambda self: self.dir is not None)
    @rule(data=st.data())
    def corrupt_file(self, data: st.DataObject) -> None:
        store = self.hicache.store
        assert isinstance(store, FileTierStore)
        store.wait_writes()
        keys = store.keys()
        if not keys:
            return
        key = data.draw(st.sampled_from(keys))
        self.corrupted.add(key)
        path = store.path(key)
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0xFF
        path.write_bytes(bytes(raw))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "hicache"):
            return
        self.cache.check_integrity()
        self.hicache.check_integrity()
        held: dict[int, int] = {}
        for r in self.reqs:
            for p in r.pages:
                held[p] = held.get(p, 0) + 1
        for p in range(self.pool.num_pages):
            assert self.pool.ref(p) == held.get(p, 0)
        for ns in NAMESPACES:
            for prefix, page in self.cache.page_map(ns).items():
                key = list(page_keys(prefix, self.ps, ns))[-1]
                assert self.io.contents[page] == key, "a tree page holds another prefix's K/V"
                if self.shard1 is not None:
                    assert self.io1.contents[page] == b"1" + key, "rank 1's shard is wrong"
        assert set(self.hicache.store.keys()) <= self.known, "the tier invented a page"


HiCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_hicache_state_machine = HiCacheMachine.TestCase
