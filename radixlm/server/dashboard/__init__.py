"""`/dashboard`: a live view of the radix tree, KV memory, the scheduler and rates.

Routes: `GET /dashboard` (the page; static files under `/dashboard/static/`, shipped as package
data, no network needed), `GET /dashboard/stream` (Server-Sent Events, one JSON payload about
every second) and `GET /dashboard/snapshot` (one payload). With `--api-key` the stream and the
snapshot need `Authorization: Bearer KEY` (the page asks for the key once and sends it with
`fetch`); the page itself holds no data and is public.

One `DashboardHub` per app samples the engine (`Engine.snapshot`: O(summary size) under the
engine lock, in a worker thread) only while at least one viewer is connected, whatever their
number, and serializes outside the lock. Rates come from the difference of cumulative counters
between samples; TTFT / TPOT percentiles from the server's sliding windows (`ServerMetrics`).
Prompt text is sent only with `--dashboard-show-text`; otherwise each node carries a hash of its
first page of token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.staticfiles import StaticFiles

from radixlm.radix.summary import SummaryOptions
from radixlm.runtime.engine import Engine
from radixlm.runtime.observe import EngineSnapshot, SnapshotOptions
from radixlm.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

STATIC_DIR = resources.files(__package__) / "static"
HISTORY_POINTS = 300  # about five minutes at 1 Hz
RATE_WINDOW_S = 60.0  # "last minute" for the hit rate
MIN_SAMPLE_GAP_S = 0.5  # samples closer than this (a viewer joining) join no time series
RATE_SMOOTH_S = 5.0  # tok/s, evictions/s, retractions/s: averaged over about this long
SUBSCRIBER_BUFFER = 4  # payloads queued for a slow viewer before older ones are dropped


@dataclass(frozen=True)
class HistoryPoint:
    """One sample of the time series the page draws."""

    t: float  # wall clock, seconds
    free: int
    held: int
    cached: int
    running: int
    waiting: int
    evictions_per_s: float  # pages
    retractions_per_s: float
    prompt_tok_per_s: float
    output_tok_per_s: float
    hit_rate: float | None  # token-weighted, over the last minute


@dataclass(frozen=True)
class Rates:
    hit_rate_1m: float | None
    hit_rate_total: float | None
    prompt_tok_per_s: float
    output_tok_per_s: float
    evictions_per_s: float
    retractions_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    ttft_count: int
    tpot_p50: float | None
    tpot_p99: float | None
    tpot_count: int


class DashboardHub:
    """Samples the engine while viewers are connected and fans the payloads out to them."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        show_text: bool = False,
        interval_s: float = 1.0,
        summary: SummaryOptions | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.show_text = show_text
        self.interval_s = interval_s
        tree = summary or SummaryOptions()
        if show_text != tree.include_tokens:
            tree = SummaryOptions(
                tree.max_depth, tree.max_children, tree.max_nodes, include_tokens=show_text
            )
        self.options = SnapshotOptions(tree=tree)
        self._samples: deque[EngineSnapshot] = deque(maxlen=HISTORY_POINTS)
        self._history: deque[HistoryPoint] = deque(maxlen=HISTORY_POINTS)
        self._subscribers: set[asyncio.Queue[bytes]] = set()
        self._task: asyncio.Task[None] | None = None
        self._state_lock = threading.Lock()  # _serialize runs in worker threads
        self.num_samples = 0

    @property
    def num_viewers(self) -> int:
        return len(self._subscribers)

    async def payload(self) -> bytes:
        """Take one sample now and return its payload (with the history so far)."""
        return await self._sample(include_history=True)

    async def subscribe(self) -> AsyncIterator[bytes]:
        """Payloads as SSE events: the first carries the history; then one per interval."""
        q: asyncio.Queue[bytes] = asyncio.Queue(maxsize=SUBSCRIBER_BUFFER)
        first = await self._sample(include_history=True)
        self._subscribers.add(q)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            yield b"data: " + first + b"\n\n"
            while True:
                yield b"data: " + await q.get() + b"\n\n"
        finally:
            self._subscribers.discard(q)

    async def _run(self) -> None:
        while self._subscribers:
            await asyncio.sleep(self.interval_s)
            if not self._subscribers:
                break
            try:
                data = await self._sample(include_history=False)
            except Exception:  # noqa: BLE001 - a failed sample must not end the stream
                logger.exception("dashboard sample failed")
                continue
            for q in list(self._subscribers):
                if q.full():
                    with contextlib.suppress(asyncio.QueueEmpty):
                        q.get_nowait()  # a slow viewer skips a frame
                q.put_nowait(data)

    async def _sample(self, include_history: bool) -> bytes:
        snap = await run_in_threadpool(self.engine.snapshot, self.options)
        return await run_in_threadpool(self._serialize, snap, include_history)

    def _serialize(self, snap: EngineSnapshot, include_history: bool) -> bytes:
        """Outside the engine lock: rates, text (when allowed), JSON."""
        with self._state_lock:
            return self._serialize_locked(snap, include_history)

    def _serialize_locked(self, snap: EngineSnapshot, include_history: bool) -> bytes:
        gap = MIN_SAMPLE_GAP_S
        older = [s for s in self._samples if snap.monotonic - s.monotonic >= gap]
        smooth = [s for s in older if snap.monotonic - s.monotonic >= RATE_SMOOTH_S]
        prev = smooth[-1] if smooth else older[0] if older else None
        record = not self._samples or snap.monotonic - self._samples[-1].monotonic >= gap
        if record:
            self._samples.append(snap)
        rates = self._rates(snap, prev)
        m, sch = snap.memory, snap.scheduler
        point = HistoryPoint(
            t=snap.wall_time,
            free=m.free_pages,
            held=m.held_pages,
            cached=m.cached_pages,
            running=sch.num_running,
            waiting=sch.num_waiting,
            evictions_per_s=rates.evictions_per_s,
            retractions_per_s=rates.retractions_per_s,
            prompt_tok_per_s=rates.prompt_tok_per_s,
            output_tok_per_s=rates.output_tok_per_s,
            hit_rate=rates.hit_rate_1m,
        )
        if record:
            self._history.append(point)
        self.num_samples += 1
        body: dict[str, Any] = {
            "time": snap.wall_time,
            "show_text": self.show_text,
            "model": str(self.engine.model_dir.name),
            "memory": asdict(m),
            "scheduler": asdict(sch),
            "counters": asdict(snap.counters),
            "rates": asdict(rates),
            "tree": self._tree(snap),
            "point": asdict(point),
            "viewers": self.num_viewers,
            "tier": None if snap.tier is None else asdict(snap.tier),
        }
        if include_history:
            body["history"] = [asdict(p) for p in self._history]
        return orjson.dumps(body)

    def _tree(self, snap: EngineSnapshot) -> dict[str, Any]:
        t = snap.tree
        nodes = []
        for n in t.nodes:
            d = asdict(n)
            ids = d.pop("head_token_ids")
            d["last_access_age_s"] = max(0.0, snap.monotonic - n.last_access_s)
            del d["last_access_s"]
            if self.show_text and ids:
                d["text"] = self.engine.tokenizer.decode(list(ids))
            nodes.append(d)
        return {
            "nodes": nodes,
            "num_nodes": t.num_nodes,
            "tree_pages": t.tree_pages,
            "page_size": t.page_size,
            "truncated": t.truncated,
        }

    def _rates(self, snap: EngineSnapshot, prev: EngineSnapshot | None) -> Rates:
        c = snap.counters
        total_hit = c.cache_hit_tokens / c.cache_queried_tokens if c.cache_queried_tokens else None
        # The hit rate over the last minute: against the oldest sample inside the window.
        base = next(
            (s for s in self._samples if snap.monotonic - s.monotonic <= RATE_WINDOW_S), None
        )
        hit_1m = total_hit
        if base is not None and base is not snap:
            dq = c.cache_queried_tokens - base.counters.cache_queried_tokens
            dh = c.cache_hit_tokens - base.counters.cache_hit_tokens
            hit_1m = dh / dq if dq else None
        per_s = {"prompt": 0.0, "output": 0.0, "evict": 0.0, "retract": 0.0}
        if prev is not None and snap.monotonic > prev.monotonic:
            dt = snap.monotonic - prev.monotonic
            pc = prev.counters
            per_s = {
                "prompt": (c.prompt_tokens - pc.prompt_tokens) / dt,
                "output": (c.generated_tokens - pc.generated_tokens) / dt,
                "evict": (snap.memory.evicted_pages - prev.memory.evicted_pages) / dt,
                "retract": (snap.memory.retractions - prev.memory.retractions) / dt,
            }
        ttft = self.metrics.recent_ttft.percentiles()
        tpot = self.metrics.recent_tpot.percentiles()
        return Rates(
            hit_rate_1m=hit_1m,
            hit_rate_total=total_hit,
            prompt_tok_per_s=per_s["prompt"],
            output_tok_per_s=per_s["output"],
            evictions_per_s=per_s["evict"],
            retractions_per_s=per_s["retract"],
            ttft_p50=ttft.p50,
            ttft_p99=ttft.p99,
            ttft_count=ttft.count,
            tpot_p50=tpot.p50,
            tpot_p99=tpot.p99,
            tpot_count=tpot.count,
        )


router = APIRouter()


def _hub(request: Request) -> DashboardHub:
    return request.app.state.dashboard


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> Response:
    return FileResponse(str(STATIC_DIR / "index.html"), media_type="text/html")


@router.get("/dashboard/snapshot")
async def dashboard_snapshot(request: Request) -> Response:
    """One dashboard payload (JSON), with the sampled history."""
    return Response(await _hub(request).payload(), media_type="application/json")


@router.get("/dashboard/stream")
async def dashboard_stream(request: Request) -> Response:
    """Server-Sent Events: one JSON payload about every second while connected."""
    return StreamingResponse(
        _hub(request).subscribe(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def static_files() -> StaticFiles:
    return StaticFiles(directory=str(STATIC_DIR))


def is_public(path: str) -> bool:
    """The page and its static files hold no data: open without a key."""
    return path in ("/dashboard", "/dashboard/") or path.startswith("/dashboard/static/")


__all__ = ["DashboardHub", "HistoryPoint", "Rates", "is_public", "router", "static_files"]
