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
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Protocol

from radixlm.radix.radix_cache import RadixCache
from radixlm.radix.tier import TierStore, namespace_key, next_key, page_keys

logger = logging.getLogger(__name__)


class Fetched(dict[bytes, bytes]):
    """``HiCache.fetch``'s payloads by key; ``buffer`` holds them (one reusable buffer per
    conversation, handed back to the ``HiCache`` by the ``load`` that consumes them)."""

    buffer: bytearray | None = None


class _Buffers:
    """Reusable fetch buffers. A fresh 46 MB buffer (a 2048-token conversation) costs ~20 ms of
    page faults here; a reused one, nothing. Thread-safe (``fetch`` takes on the loader thread,
    ``load`` gives back on the loop thread)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if len(buf) >= nbytes:
                    return self._free.pop(i)
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=len)
            del self._free[: max(0, len(self._free) - self._keep)]  # keep the largest


def take_payloads(
    keys: Iterable[bytes],
    prefetched: Fetched | None,
    store: TierStore,
    limit: int | None = None,
) -> tuple[list[bytes], list[bytes], int]:
    """The leading ``keys`` (at most ``limit``) with their payloads, each popped from
    ``prefetched`` or else read from ``store``, up to the first neither holds (missing or
    corrupt); and how many came from ``prefetched``."""
    taken: list[bytes] = []
    payloads: list[bytes] = []
    from_prefetched = 0
    for key in keys:
        if limit is not None and len(payloads) >= limit:
            break
        payload = prefetched.pop(key, None) if prefetched else None
        if payload is not None:
            from_prefetched += 1
        else:
            payload = store.get(key)
        if payload is None:
            break
        taken.append(key)
        payloads.append(payload)
    return taken, payloads, from_prefetched


class PageIO(Protocol):
    """Reads and writes the K/V of whole pool pages as opaque payloads (the runtime's codec).
    One with a ``page_bytes`` attribute (every payload's size) lets ``HiCache.fetch`` read a
    conversation's page files into one buffer."""

    def read_pages(self, pages: Sequence[int]) -> list[bytes]: ...

    def write_pages(self, pages: Sequence[int], payloads: Sequence[bytes]) -> None: ...


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


class TierShard:
    """One rank's shard of the tier: its own store and page codec, no policy of its own (it
    does what rank 0 decided). Implements ``TierFollowers`` for itself: ``fetch`` reads on the
    shard's reader thread (started on the first), and the ``load`` of those keys claims that
    read; at most ``MAX_UNCLAIMED_READS`` reads wait to be claimed (a request aborted while its
    pages were read never claims them), past it the oldest is forgotten."""

    MAX_UNCLAIMED_READS = 8

    def __init__(self, store: TierStore, io: PageIO) -> None:
        self.tier_store = store
        self.io = io
        self._io_failed_logged = False
        self._buffers = _Buffers(keep=2)
        self._reader: ThreadPoolExecutor | None = None
        # unclaimed background reads, oldest first: (the keys read, their future)
        self._reads: deque[tuple[frozenset[bytes], Future[Fetched]]] = deque()
        self.prefetched_pages = 0  # pages a ``load`` took from a background read

    def store(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[bytes]:
        """Store this rank's shard of ``pages``; returns the keys stored (none when reading
        the pages failed: logged once, eviction goes on)."""
        try:
            payloads = self.io.read_pages(pages)
        except Exception:  # noqa: BLE001 - the tier is an optimization: never fail eviction
            if not self._io_failed_logged:
                self._io_failed_logged = True
                logger.exception("hicache: reading pages for the tier failed (logged once)")
            return []
        puts = [(k, self.tier_store.put(k, p)) for k, p in zip(keys, payloads, strict=True)]
        return [k for k, ok in puts if ok]

    def read(self, keys: Sequence[bytes]) -> Fetched:
        """Read and verify the payloads of ``keys`` (stops at the first missing or corrupt one)
        into one reused buffer (with a codec that has ``page_bytes``: page files straight into
        it). Touches only the store, which is thread-safe: a background thread calls this while
        the forward runs; the ``load`` that consumes the result hands the buffer back."""
        out = Fetched()
        page_bytes = getattr(self.io, "page_bytes", 0)
        buf = None
        if page_bytes and keys:
            out.buffer = self._buffers.take(len(keys) * page_bytes)
            buf = memoryview(out.buffer)
        for j, key in enumerate(keys):
            into = buf[j * page_bytes : (j + 1) * page_bytes] if buf is not None else None
            payload = self.tier_store.get(key, into)
            if payload is None:
                break
            out[key] = payload
        return out

    def release(self, fetched: Fetched | None) -> None:
        """Done with ``fetched``'s payloads: empty it and take its buffer back for reuse."""
        if fetched is not None and fetched.buffer is not None:
            fetched.clear()
            buffer, fetched.buffer = fetched.buffer, None
            self._buffers.give(buffer)

    def fetch(self, keys: Sequence[bytes]) -> None:
        """Start reading ``keys`` on the reader thread, for a later ``load`` to claim."""
        if not keys:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="hicache-shard")
        self._reads.append((frozenset(keys), self._reader.submit(self.read, list(keys))))
        while len(self._reads) > self.MAX_UNCLAIMED_READS:
            self._reads.popleft()

    def _claim(self, first: bytes) -> Fetched | None:
        """The newest unclaimed read that holds ``first`` (waited for), removed; or None."""
        for i in range(len(self._reads) - 1, -1, -1):
            keys, fut = self._reads[i]
            if first in keys:
                del self._reads[i]
                try:
                    return fut.result()
                except Exception:  # noqa: BLE001 - the load reads the pages itself
                    logger.exception("hicache: a background read of tier pages failed")
                    return None
        return None

    def load(
        self, keys: Sequence[bytes], pages: Sequence[int], prefetched: Fetched | None = None
    ) -> int:
        """Write the payloads of ``keys`` into ``pages``, from ``prefetched`` (else from the
        background read of ``fetch`` that holds the first key, waited for) and the rest read
        now; consumes the read. Returns how many leading pages were written."""
        if prefetched is None and keys:
            prefetched = self._claim(keys[0])
        try:
            _, payloads, n_pre = take_payloads(keys, prefetched, self.tier_store)
            self.prefetched_pages += n_pre
            self.io.write_pages(pages[: len(payloads)], payloads)
            return len(payloads)
        finally:
            self.release(prefetched)

    def drop(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.tier_store.drop(key)

    def retain(self, keys: Sequence[bytes]) -> None:
        keep = set(keys)
        self.drop([k for k in self.tier_store.keys() if k not in keep])

    def clear(self) -> None:
        self._reads.clear()
        self.tier_store.clear()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader = None
        self._reads.clear()
        self.tier_store.close()


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
