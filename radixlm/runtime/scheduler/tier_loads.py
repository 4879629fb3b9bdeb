"""Background reads of second-tier pages for waiting requests, so that a returning conversation
waits in the queue (not in the forward, and without stalling the loop) while its pages are read
and verified.

Admission asks `ready(req, tokens, start)` before adopting a request's prefix: when the tier
holds the page after the pool's match, one thread reads the consecutive tier pages
(`HiCache.read` of the keys `HiCache.fetch_keys` found; with tensor parallel the other ranks
start reading their shards of them on their own threads at the same time) while the loop goes
on stepping, and the request is skipped until that read is done (the loop is woken by
`on_done`); `take(req)` then hands the payloads to `HiCache.load`, which writes them into fresh
pool pages on the loop thread. Payloads read too early are still right (a page is named by its
whole prefix); pages the read missed are read synchronously by `load`.

NOTE: one owner: the scheduler's `PageManager`; the futures are touched by the loop thread only
(the worker thread only runs `HiCache.read`, which touches only the thread-safe store).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from radixlm.radix import HiCache
from radixlm.radix.tier_shard import Fetched
from radixlm.runtime.request import Request

logger = logging.getLogger(__name__)

# Reads held at once (in flight, or done and not yet taken): their payloads sit in memory, a
# whole conversation each. Past it, a request waits for a slot while a read is in flight, and
# reads its pages synchronously when none is (so that nothing waits on a wake that never comes).
MAX_READS = 4


class TierLoads:
    def __init__(self, hicache: HiCache) -> None:
        self.hicache = hicache
        self.on_done: Callable[[], None] | None = None  # wakes the engine loop
        self._pool: ThreadPoolExecutor | None = None
        self._fetches: dict[int, tuple[Request, Future[Fetched]]] = {}

    def ready(
        self, req: Request, tokens: Sequence[int], namespace: Hashable | None, start: int
    ) -> bool:
        """True when `req` can adopt its prefix now: nothing to read from the tier, or its read
        is done. Otherwise starts the read (once) and returns False."""
        entry = self._fetches.get(id(req))
        if entry is not None and entry[0] is req:
            return entry[1].done()
        if not self.hicache.has_next(tokens, namespace, start):
            return True
        if len(self._fetches) >= MAX_READS:
            return not self._in_flight()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hicache-load")
        # the keys here (the tensor-parallel followers start their reads now), the reads there
        keys = self.hicache.fetch_keys(tokens, namespace, start)
        fut = self._pool.submit(self.hicache.read, keys)
        if self.on_done is not None:
            wake = self.on_done
            fut.add_done_callback(lambda _: wake())
        self._fetches[id(req)] = (req, fut)
        return False

    def pending(self, req: Request) -> bool:
        """`req` waits for a read: its own, or a slot while all are held and one is in flight
        (whose end wakes the loop)."""
        entry = self._fetches.get(id(req))
        if entry is not None and entry[0] is req:
            return not entry[1].done()
        return len(self._fetches) >= MAX_READS and self._in_flight()

    def _in_flight(self) -> bool:
        return any(not fut.done() for _, fut in self._fetches.values())

    def take(self, req: Request) -> Fetched | None:
        """The finished read's payloads by key (None: no read, or it failed)."""
        entry = self._fetches.pop(id(req), None)
        if entry is None or entry[0] is not req or not entry[1].done():
            return None
        try:
            return entry[1].result()
        except Exception:  # noqa: BLE001 - a failed read: `load` reads again, or recomputes
            logger.exception("hicache: reading tier pages failed")
            return None

    def retain(self, waiting: Iterable[Request]) -> None:
        """Forget reads for requests no longer waiting (aborted, failed)."""
        keep = {id(r) for r in waiting}
        for key in [k for k in self._fetches if k not in keep]:
            del self._fetches[key]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
