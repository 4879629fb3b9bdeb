"""Prometheus metrics for `GET /metrics`.

Two sources: the engine's own counters and gauges (`Engine.stats()`: tokens, cache hits, KV pages,
queue lengths), read at scrape time by a custom collector, and latency histograms the server
times itself from the deltas it receives (time to first token, time per output token,
end-to-end). Each app gets its own registry, so several servers can live in one process.

Kubernetes routing (Gateway API Inference Extension's endpoint picker, as used by llm-d and
KServe) scrapes three gauges of its model-server protocol: TotalQueuedRequests,
TotalRunningRequests and KVCacheUtilization. The protocol lets a server pick the names; the
picker's defaults are vLLM's, so radixlm also exports them under those names
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` and its
older name `vllm:gpu_cache_usage_perc`, plus
`vllm:cache_config_info{block_size, num_gpu_blocks}` for prefix-aware scorers) and the picker
needs no flags. The same values are in `radixlm_num_requests_waiting`,
`radixlm_num_requests_running` and `radixlm_kv_cache_usage_perc` (deploy/README.md says how to
point the picker at those instead).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixlm.runtime.outputs import EngineStats

PREFIX = "radixlm"
GATEWAY_PREFIX = "vllm:"  # the Inference Extension endpoint picker's default metric names
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class EngineCollector(Collector):
    """Reads `Engine.stats()` at scrape time (call `generate_latest` off the event loop: the
    stats take the engine lock, which a running step holds)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        counters = {
            "prompt_tokens": ("Prompt tokens of admitted requests", s.prompt_tokens),
            "generation_tokens": ("Generated tokens", s.generated_tokens),
            "computed_prompt_tokens": (
                "Prompt tokens run through the model (cache misses and recomputation)",
                s.computed_prompt_tokens,
            ),
            "cache_hit_tokens": ("Prompt tokens served from the radix cache", s.cache_hit_tokens),
            "cache_queried_tokens": (
                "Prompt tokens looked up in the radix cache",
                s.cache_queried_tokens,
            ),
            "retractions": ("Requests preempted for lack of KV pages", s.num_retractions),
            "spec_decode_num_drafts": ("Speculative drafts verified", s.spec_drafts),
            "spec_decode_num_draft_tokens": (
                "Speculative draft tokens verified",
                s.spec_draft_tokens,
            ),
            "spec_decode_num_accepted_tokens": (
                "Speculative draft tokens accepted",
                s.spec_accepted_tokens,
            ),
            "hicache_hit_tokens": (
                "Prompt tokens loaded from the second KV tier instead of computed",
                s.hicache_hit_tokens,
            ),
            "hicache_loaded_pages": (
                "KV pages loaded from the second tier",
                s.hicache_loaded_pages,
            ),
            "hicache_load_seconds": (
                "Seconds spent loading KV pages from the second tier",
                s.hicache_load_seconds,
            ),
            "hicache_stored_pages": ("KV pages written to the second tier", s.hicache_stored_pages),
            "hicache_dropped_pages": (
                "Second-tier pages dropped as corrupt, truncated or foreign",
                s.hicache_dropped_pages,
            ),
            "hicache_write_errors": (
                "Second-tier page writes that failed (full disk ...)",
                s.hicache_write_errors,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        verifier = CounterMetricFamily(
            f"{PREFIX}_grammar_verifier_events",
            "Sampled tokens the JSON-schema verifier refused (masked), redraws after them "
            "(resampled), rows left with no allowed token (dead_ends) and dead ends left by "
            "rolling back (rollbacks), per keyword",
            labels=["keyword", "event"],
        )
        for keyword, events in sorted(s.verifier_events.items()):
            for event, count in events.items():
                verifier.add_metric([keyword, event], count)
        yield verifier
        gauges = {
            "cache_hit_rate": (
                "Radix cache hit rate (hit / queried prompt tokens)",
                s.cache_hit_rate,
            ),
            "num_requests_running": ("Sequences being computed", s.num_running),
            "num_requests_waiting": ("Sequences waiting for admission", s.num_waiting),
            "kv_pages_total": ("KV cache pages in the pool", s.kv_pages_total),
            "kv_pages_used": ("KV pages held by running requests", s.kv_pages_used),
            "kv_pages_cached": ("KV pages cached in the radix tree, evictable", s.kv_pages_cached),
            "kv_pages_free": ("Free KV pages", s.kv_pages_free),
            "kv_page_size": ("Tokens per KV page", s.page_size),
            "hicache_pages": ("KV pages in the second tier", s.hicache_pages),
            "hicache_bytes": ("Bytes of KV pages in the second tier", s.hicache_bytes),
            "hicache_capacity_bytes": (
                "The second tier's capacity in bytes (0: off)",
                s.hicache_capacity_bytes,
            ),
            "spec_decode_acceptance_rate": (
                "Accepted / verified speculative draft tokens (0 without drafting)",
                s.spec_accepted_tokens / s.spec_draft_tokens if s.spec_draft_tokens else 0.0,
            ),
            "spec_decode_mean_accepted_length": (
                "Accepted draft tokens per verified draft (0 without drafting)",
                s.spec_accepted_tokens / s.spec_drafts if s.spec_drafts else 0.0,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        usage = kv_cache_usage(s)
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_perc",
            "KV cache usage: pages held by running requests / all pages (1 = full)",
            value=usage,
        )
        yield from inference_gateway_metrics(s, usage)


def kv_cache_usage(s: EngineStats) -> float:
    """Fraction of KV pages held by running requests. Pages cached in the radix tree with no
    holder are evictable, so they count as free (vLLM counts its cached free blocks the same)."""
    return s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0


def inference_gateway_metrics(s: EngineStats, usage: float) -> Iterator[Metric]:
    """The model-server protocol gauges under the endpoint picker's default (vLLM) names."""
    yield GaugeMetricFamily(
        f"{GATEWAY_PREFIX}num_requests_waiting",
        "TotalQueuedRequests: requests waiting for admission",
        value=s.num_waiting,
    )
    yield GaugeMetricFamily(
        f"{GATEWAY_PREFIX}num_requests_running",
        "TotalRunningRequests: requests being computed",
        value=s.num_running,
    )
    for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):  # current and older pickers
        yield GaugeMetricFamily(
            f"{GATEWAY_PREFIX}{name}", "KVCacheUtilization: KV cache usage (1 = full)", value=usage
        )
    info = GaugeMetricFamily(
        f"{GATEWAY_PREFIX}cache_config_info",
        "KV cache geometry: tokens per block and number of blocks",
        labels=["block_size", "num_gpu_blocks"],
    )
    info.add_metric([str(s.page_size), str(s.kv_pages_total)], 1.0)
    yield info


@dataclass(frozen=True)
class LatencyPercentiles:
    count: int
    p50: float | None
    p99: float | None


class RecentWindow:
    """Observations of the last ``window_s`` seconds (at most ``max_items``), for percentiles
    over a sliding window (the dashboard's "last minute"; histograms only give all-time)."""

    def __init__(self, window_s: float = 60.0, max_items: int = 50_000) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque(maxlen=max_items)
        self._lock = threading.Lock()

    def add(self, value: float, now: float | None = None) -> None:
        with self._lock:
            self._items.append((time.monotonic() if now is None else now, value))

    def percentiles(self, now: float | None = None) -> LatencyPercentiles:
        """Nearest-rank p50 and p99 of the observations in the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._items and self._items[0][0] < now - self.window_s:
                self._items.popleft()
            values = sorted(v for _, v in self._items)
        if not values:
            return LatencyPercentiles(0, None, None)
        return LatencyPercentiles(len(values), _rank(values, 0.50), _rank(values, 0.99))


def _rank(sorted_values: list[float], q: float) -> float:
    k = max(1, -(-len(sorted_values) * q // 1))  # ceil(n * q), nearest-rank definition
    return sorted_values[int(k) - 1]


class ServerMetrics:
    """The server's registry: engine collector + request histograms and counters."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(stats))
        reg = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from submission to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between generated tokens of one sequence (after the first)",
            buckets=TPOT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Time from submission to the last sequence of a prompt finishing",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Prompts finished (all their sequences)",
            registry=reg,
        )
        self.sequences = Counter(
            f"{PREFIX}_sequences_finished",
            "Sequences finished, by finish reason",
            ["finish_reason"],
            registry=reg,
        )
        self.request_cached_tokens = Counter(
            f"{PREFIX}_request_cached_tokens",
            "Prompt tokens served from the radix cache, summed over finished prompts",
            registry=reg,
        )
        self.recent_ttft = RecentWindow()
        self.recent_tpot = RecentWindow()

    def observe_sequence(
        self, finish_reason: str, ttft: float | None, tokens: int, decode_seconds: float
    ) -> None:
        self.sequences.labels(finish_reason=finish_reason).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
            self.recent_ttft.add(ttft)
        if tokens > 1:
            self.tpot.observe(decode_seconds / (tokens - 1))
            self.recent_tpot.add(decode_seconds / (tokens - 1))

    def observe_request(self, e2e_seconds: float, cached_tokens: int) -> None:
        self.requests.inc()
        self.e2e.observe(e2e_seconds)
        self.request_cached_tokens.inc(cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
