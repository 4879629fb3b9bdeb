"""One rank's shard of the second KV tier: its store and page codec, and reads into reusable
buffers (``TierShard``), with the pieces rank 0's ``HiCache`` shares with it (``Fetched``,
``take_payloads``, ``PageIO``).

A shard has no policy of its own: it stores, loads, drops what rank 0 decided (directly on rank
0, through the step broadcast on the other tensor-parallel ranks). ``fetch`` starts a background
read on the shard's reader thread; the ``load`` of those keys claims it (waiting only if it still
runs) and reads only what it lacks. Invariant: a payload that fails verification is never
written into the pool (the store drops it; the load stops there).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from radixlm.radix.tier import TierStore

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
