"""What a cache-aware router (SGLang's Rust router lineage: `smg`, `sglang-router`) reads from
a SGLang worker, so that a `radixlm serve` process is a first-class worker behind it.

- `GET /server_info`: SGLang's flat server description (`model_path`, `served_model_name`,
  `tp_size`, `dp_size`, `context_length`, `max_total_tokens`, `max_running_requests`,
  `version`, ...). The router probes it to tell an SGLang worker from a vLLM one when
  `/v1/models` `owned_by` is not a name it knows (here: `radixlm`), and reads `dp_size` from it.
- `GET /model_info`: `model_path`, `tokenizer_path`, `is_generation`, `model_type`,
  `architectures`, `eos_token_ids`. The `/get_*` spellings are in `control_api` (deprecated
  there, still read by older clients).
- `GET /v1/loads`: the router's `WorkerLoadResponse` (one scheduler: `dp_rank_count` 1),
  polled by its load monitor for the load-aware policies and the cache-aware policy's
  imbalance fallback.
- `GET /get_load`: SGLang's older load list, read by `sglang-router`.

Every number comes from `Engine.stats()`; `num_waiting_uncached_tokens` is not reported (the
router's schema defaults it to 0 and treats it as unknown).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

import radixlm
from radixlm.runtime.outputs import EngineStats
from radixlm.server.errors import OrjsonResponse
from radixlm.server.serving import engine_client

router = APIRouter()


@dataclass(frozen=True)
class WorkerLoad:
    """One scheduler's load, in the router's `SchedulerLoadSnapshot` names."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int  # KV tokens held by running requests
    max_total_num_tokens: int  # KV pool capacity in tokens
    token_usage: float  # num_used_tokens / max_total_num_tokens, in [0, 1]
    gen_throughput: float  # generated tokens per second since the previous poll
    cache_hit_rate: float
    max_running_requests: int

    def snapshot(self, dp_rank: int = 0) -> dict[str, Any]:
        return {
            "dp_rank": dp_rank,
            "num_running_reqs": self.num_running_reqs,
            "num_waiting_reqs": self.num_waiting_reqs,
            "num_total_reqs": self.num_running_reqs + self.num_waiting_reqs,
            "num_used_tokens": self.num_used_tokens,
            "max_total_num_tokens": self.max_total_num_tokens,
            "token_usage": self.token_usage,
            "gen_throughput": self.gen_throughput,
            "cache_hit_rate": self.cache_hit_rate,
            "utilization": self.token_usage,
            "max_running_requests": self.max_running_requests,
        }


class ThroughputMeter:
    """Generated tokens per second between two reads of the engine's token counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[float, int] | None = None

    def rate(self, generated_tokens: int) -> float:
        now = time.monotonic()
        with self._lock:
            last, self._last = self._last, (now, generated_tokens)
        if last is None or now <= last[0]:
            return 0.0
        return max(generated_tokens - last[1], 0) / (now - last[0])


def worker_load(stats: EngineStats, max_running_requests: int, throughput: float) -> WorkerLoad:
    capacity = stats.kv_pages_total * stats.page_size
    used = stats.kv_pages_used * stats.page_size
    return WorkerLoad(
        num_running_reqs=stats.num_running,
        num_waiting_reqs=stats.num_waiting,
        num_used_tokens=used,
        max_total_num_tokens=capacity,
        token_usage=used / capacity if capacity else 0.0,
        gen_throughput=throughput,
        cache_hit_rate=stats.cache_hit_rate,
        max_running_requests=max_running_requests,
    )


def _meter(request: Request) -> ThroughputMeter:
    state = request.app.state
    if getattr(state, "throughput_meter", None) is None:
        state.throughput_meter = ThroughputMeter()
    return state.throughput_meter


async def _load(request: Request) -> WorkerLoad:
    engine = engine_client(request).engine
    # NOTE: stats() takes the engine lock, which a running step holds: off the event loop.
    stats = await run_in_threadpool(engine.stats)
    return worker_load(
        stats,
        engine.config.scheduler.max_running_requests,
        _meter(request).rate(stats.generated_tokens),
    )


@router.get("/server_info")
async def server_info(request: Request) -> Response:
    client = engine_client(request)
    engine = client.engine
    stats = await run_in_threadpool(engine.stats)
    model_path = str(engine.model_dir)
    return OrjsonResponse(
        {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "served_model_name": client.model_name,
            "version": radixlm.__version__,
            "engine": "radixlm",
            "tp_size": int(getattr(engine, "tp_size", 1)),
            "dp_size": 1,  # one scheduler per process; replicas are separate workers
            "pp_size": 1,
            "is_embedding": False,
            "disaggregation_mode": "null",
            "context_length": engine.max_model_len,
            "max_total_tokens": stats.kv_pages_total * stats.page_size,
            "max_running_requests": engine.config.scheduler.max_running_requests,
            "page_size": stats.page_size,
            "dtype": engine.config.dtype,
            "enable_prefix_caching": engine.config.cache.enable_prefix_caching,
            "schedule_policy": engine.config.scheduler.schedule_policy,
            "chunked_prefill_size": engine.config.scheduler.chunked_prefill_size,
        }
    )


@router.get("/v1/loads")
async def loads(request: Request) -> Response:
    load = await _load(request)
    return OrjsonResponse(
        {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "dp_rank_count": 1,
            "loads": [load.snapshot()],
        }
    )


@router.get("/get_load")
async def get_load(request: Request) -> Response:
    load = await _load(request)
    return OrjsonResponse(
        [
            {
                "dp_rank": 0,
                "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
                "num_waiting_reqs": load.num_waiting_reqs,
                "num_tokens": load.num_used_tokens,
            }
        ]
    )
