"""Hierarchical cache: the radix tree's pool pages over a second tier (``TierStore``).

``HiCache`` owns the tier store and its counters; the tree and the pool stay the
``RadixCache``'s. Pages move between tiers at two moments only:

- **down, on eviction (write-back)**: ``RadixCache.evict`` calls ``on_evict`` with the pages it
  is about to free, while their K/V are still intact; each page not already in the tier is read
  through the ``PageIO`` and stored under its ``page_key``. ``write_back_all`` does the same for
  every tree page (a clean shutdown, so that a restart finds them).
- **up, on a match (load)**: after the pool match, ``load`` finds the consecutive next pages of
  the prompt in the tier, allocates fresh pool pages for them (evicting cached leaves when
  short), writes the payloads in and hands the pages to the caller, who holds one ref on each
  and inserts them into the tree like computed pages.

With tensor parallel, every rank holds its own shard of each page (its KV heads) in its own
store under the same key. Rank 0's ``HiCache`` is the one owner of the tier's state: its store's
index decides what is stored, loaded and dropped, and the other ranks (``TierFollowers``) do the
same to their shards in the same order. A page is served only when every rank loaded its shard
(one missing or corrupt shard: the page is released, its key dropped everywhere, the tokens are
recomputed); keys rank 0's store forgets are dropped on the followers with the next operation.

Invariants: only pages that were in the tree enter the tier, so only whole, computed (verified)
pages do; a tier page is found only under the key of its whole prefix; a payload that fails
verification is never written into the pool (the store drops it, the page is recomputed);
``load`` never takes pages below ``reserve`` free ones and never touches a held page.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from radixlm.radix.radix_cache import RadixCache
from radixlm.radix.tier import TierStore, namespace_key, next_key, page_keys
from radixlm.radix.tier_shard import Fetched, PageIO, TierShard, take_payloads

logger = logging.getLogger(__name__)


class TierFollowers(Protocol):
    """The other tensor-parallel ranks' shards of the tier (``TierShard`` on each rank), told
    what to do by rank 0's ``HiCache``: the same keys and pool pages on every rank."""

    def store(self, keys: Sequence[bytes], pages: Sequence[int]) -> None:
        """Store each rank's shard of ``pages`` under ``keys`` (the pages are still intact)."""
        ...

    def fetch(self, keys: Sequence[bytes]) -> None:
        """Start reading each rank's shard of ``keys`` in the background (a ``load`` of them
        follows, or never: a rank keeps a bounded number of unclaimed reads)."""
        ...

    def load(self, keys: Sequence[bytes], pages: Sequence[int]) -> int:
        """Write each rank's shard stored under ``keys`` into ``pages`` (from its background
        read where one holds them); returns how many leading pages every rank wrote (a page
        past it is not whole on every rank)."""
        ...

    def drop(self, keys: Sequence[bytes]) -> None: ...

    def retain(self, keys: Sequence[bytes]) -> None:
        """Drop every stored key not in ``keys`` (rank 0's index after a warm restart)."""
        ...

    def clear(self) -> None: ...


@dataclass(frozen=True)
class HiCacheStats:
    """The tier's occupancy and cumulative traffic."""

    pages: int
    used_bytes: int
    capacity_bytes: int
    hit_tokens: int  # prompt tokens loaded from the tier instead of computed
    loaded_pages: int
    prefetched_pages: int  # of those, read by a background ``fetch`` before admission
    load_seconds: float  # spent reading the tier (in the background too) and writing pool pages
    stored_pages: int  # written to the tier (evictions, shutdown write-back)
    dropped_pages: int  # corrupt / truncated / foreign pages dropped
    write_errors: int
    storage: str  # "host" or the directory of the file store


class HiCache:
    def __init__(
        self,
        cache: RadixCache,
        store: TierStore,
        io: PageIO,
        storage: str = "host",
        write_through: bool = False,
        followers: TierFollowers | None = None,
    ) -> None:
        self.cache = cache
        self.write_through = write_through
        self.pool = cache.pool
        self.page_size = cache.page_size
        self.store = store
        self.io = io
        self.storage = storage
        self._hit_tokens = 0
        self._loaded_pages = 0
        self._prefetched_pages = 0
        self._load_seconds = 0.0  # written by the loop thread (``load``)
        self._fetch_seconds = 0.0  # written by the fetching thread (``fetch``)
        self._stored_pages = 0
        self.shard = TierShard(store, io)  # this rank's (rank 0's) shard
        self.followers = followers
        self._forgotten: deque[bytes] = deque()  # keys to drop on the followers
        if followers is not None:
            store.on_forget = self._forgotten.append
            followers.retain(store.keys())
        cache.evict_listener = self.on_evict

    # ---- down: eviction --------------------------------------------------------------------------
    def on_evict(
        self, namespace: Hashable | None, prefix: tuple[int, ...], victims: list[int]
    ) -> None:
        """``prefix`` ends with the ``victims``' tokens: store the pages the tier lacks."""
        keys = list(page_keys(prefix, self.page_size, namespace))[-len(victims) :]
        self._store([(k, p) for k, p in zip(keys, victims, strict=True)])

    def on_cached(
        self, namespace: Hashable | None, tokens: Sequence[int], pages: Sequence[int]
    ) -> int:
        """Write-through: ``pages`` (whole, in the tree) hold ``tokens``; store those the tier
        lacks. Returns the pages stored."""
        keys = page_keys(tokens, self.page_size, namespace)
        return self._store(list(zip(keys, pages, strict=True)))

    def write_back_all(self) -> int:
        """Store every tree page the tier lacks (a clean shutdown); returns the pages stored.

        Deepest pages first, so that shared prefixes (system prompts) are the most recently
        used in the tier's LRU and outlive the rest when it overflows."""
        todo: list[tuple[int, bytes, int]] = []
        ps = self.page_size
        for ns in list(self.cache.roots()):
            memo: dict[tuple[int, ...], bytes] = {(): namespace_key(ns)}
            for prefix, page in sorted(self.cache.page_map(ns).items(), key=lambda e: len(e[0])):
                key = memo[prefix] = next_key(memo[prefix[:-ps]], prefix[-ps:])
                todo.append((len(prefix), key, page))
        todo.sort(key=lambda e: -e[0])
        return self._store([(key, page) for _, key, page in todo])

    def _store(self, pairs: list[tuple[bytes, int]]) -> int:
        pairs = [(k, p) for k, p in pairs if not self.store.contains(k)]
        if not pairs:
            return 0
        stored = len(self.shard.store([k for k, _ in pairs], [p for _, p in pairs]))
        self._stored_pages += stored
        if self.followers is not None and stored:
            # still indexed (a later put of this batch may have evicted an earlier one)
            kept = [(k, p) for k, p in pairs if self.store.contains(k)]
            self._drop_forgotten()
            self.followers.store([k for k, _ in kept], [p for _, p in kept])
        return stored

    def _drop_forgotten(self) -> None:
        """Tell the followers which keys rank 0's store forgot since the last call."""
        if self.followers is None or not self._forgotten:
            return
        keys = []
        while self._forgotten:
            keys.append(self._forgotten.popleft())
        self.followers.drop(keys)

    # ---- up: load on a match ---------------------------------------------------------------------
    def has_next(self, tokens: Sequence[int], namespace: Hashable | None, start: int) -> bool:
        """Whether the tier holds the page of ``tokens`` right after ``start`` (page-aligned)
        tokens: O(start / page_size) hashes, no read."""
        return self.peek_len(tokens[: start + self.page_size], namespace, start) > 0

    def peek_len(self, tokens: Sequence[int], namespace: Hashable | None, start: int) -> int:
        """Tokens in the tier's consecutive whole pages of ``tokens`` after the first ``start``
        (page-aligned: the pool's match): index look-ups only, no read, nothing touched."""
        ps = self.page_size
        if len(tokens) - start < ps or self.store.stats().pages == 0:
            return 0
        n = 0
        for i, key in enumerate(page_keys(tokens, ps, namespace)):
            if i * ps < start:
                continue
            if not self.store.contains(key):
                break
            n += ps
        return n

    def fetch_keys(
        self, tokens: Sequence[int], namespace: Hashable | None, start: int
    ) -> list[bytes]:
        """The keys of the tier's consecutive pages of ``tokens`` after ``start`` tokens (at
        most a pool's worth): index look-ups only. The followers start reading their shards of
        them now, so call it on the thread that steps the engine (it sends a step op)."""
        keys = []
        for i, key in enumerate(page_keys(tokens, self.page_size, namespace)):
            if i * self.page_size < start:
                continue
            if len(keys) >= self.pool.num_pages or not self.store.contains(key):
                break
            keys.append(key)
        if self.followers is not None and keys:
            self._drop_forgotten()
            self.followers.fetch(keys)
        return keys

    def read(self, keys: Sequence[bytes]) -> Fetched:
        """Read and verify this rank's payloads of ``keys`` (``fetch_keys``): thread-safe, for
        a background thread while the forward runs; ``load`` takes the result."""
        t0 = time.perf_counter()
        try:
            return self.shard.read(keys)
        finally:
            self._fetch_seconds += time.perf_counter() - t0

    def fetch(self, tokens: Sequence[int], namespace: Hashable | None, start: int) -> Fetched:
        """``read(fetch_keys(...))`` on one thread."""
        return self.read(self.fetch_keys(tokens, namespace, start))

    def load(
        self,
        tokens: Sequence[int],
        namespace: Hashable | None,
        start: int,
        reserve: int = 0,
        prefetched: Fetched | None = None,
    ) -> list[int]:
        """Pool pages holding the tier's copies of the whole pages of ``tokens`` after the first
        ``start`` tokens (the pool match; page-aligned), consecutive from there. The caller holds
        one ref on each page returned and must insert them into the tree (or release them).
        Leaves at least ``reserve`` pages free; the caller's matched prefix must be locked.
        ``prefetched`` (from ``fetch``) is used first; pages it lacks are read now. It is
        consumed: emptied, and its buffer goes back for the next ``fetch``."""
        try:
            return self._load(tokens, namespace, start, reserve, prefetched)
        finally:
            self.shard.release(prefetched)

    def _load(
        self,
        tokens: Sequence[int],
        namespace: Hashable | None,
        start: int,
        reserve: int,
        prefetched: Fetched | None,
    ) -> list[int]:
        ps = self.page_size
        if start % ps:
            raise ValueError(f"load starts at {start}, not a page boundary of {ps}")
        if len(tokens) - start < ps or (self.store.stats().pages == 0 and not prefetched):
            return []
        t0 = time.perf_counter()
        limit = self.pool.num_pages - self.pool.num_held - reserve  # free or evictable, at most
        wanted = islice(page_keys(tokens, ps, namespace), start // ps, None)
        keys, payloads, n_pre = take_payloads(wanted, prefetched, self.store, limit)
        self._prefetched_pages += n_pre
        if not payloads:
            return []
        short = len(payloads) + reserve - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        n = max(0, min(len(payloads), self.pool.num_free - reserve))
        pages = self.pool.alloc(n)
        try:
            self.io.write_pages(pages, payloads[:n])
            pages = self._load_followers(keys[:n], pages)
        except Exception:
            self.pool.decref(pages)
            raise
        n = len(pages)
        self._hit_tokens += n * ps
        self._loaded_pages += n
        self._load_seconds += time.perf_counter() - t0
        return pages

    def _load_followers(self, keys: list[bytes], pages: list[int]) -> list[int]:
        """The leading ``pages`` every follower wrote its shard into (all of them without
        followers); the rest are released and the first key no rank could serve is dropped."""
        if self.followers is None or not pages:
            return pages
        self._drop_forgotten()
        ok = self.followers.load(keys, pages)
        if ok < len(pages):
            logger.warning(
                "hicache: a tensor-parallel rank lacks its shard of %d tier pages; "
                "recomputing them", len(pages) - ok,
            )  # fmt: skip
            self.pool.decref(pages[ok:])
            self.store.drop(keys[ok])
            self._drop_forgotten()
        return pages[:ok]

    # ---- control ---------------------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every tier page (``/flush_cache``), on every rank."""
        self.store.clear()
        if self.followers is not None:
            self._forgotten.clear()
            self.followers.clear()

    def close(self) -> None:
        """Finish pending tier writes."""
        self.store.close()

    def stats(self) -> HiCacheStats:
        s = self.store.stats()
        return HiCacheStats(
            pages=s.pages,
            used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes,
            hit_tokens=self._hit_tokens,
            loaded_pages=self._loaded_pages,
            prefetched_pages=self._prefetched_pages,
            load_seconds=self._load_seconds + self._fetch_seconds,
            stored_pages=self._stored_pages,
            dropped_pages=s.dropped_pages,
            write_errors=s.write_errors,
            storage=self.storage,
        )

    def check_integrity(self) -> None:
        self.store.check_integrity()
