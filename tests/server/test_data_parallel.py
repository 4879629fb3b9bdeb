"""`radixlm serve --dp-size 2` behind the `smg` router, on loopback.

The replicas serve the tiny random-weight Llama (with the default model's tokenizer and chat
template): routing and cache hits depend on the prompts' tokens, not on the weights, and the tiny
model keeps the three measured runs short.

One launcher process (the code under test) starts two replicas and the router with the
`cache_aware` policy. The workload: several conversations, each with its own long system prompt,
interleaved, one request at a time. It runs three times over the same two replicas, their caches
flushed in between: through the cache-aware router, through a second router with
`round_robin`, and straight to one replica. The radix-cache hit rates (from the replicas' own
counters) show the point of cache-aware routing: a prefix stays on one replica, so the hit rate
matches one replica's, while round-robin computes every prefix once per replica. Last, a replica
is killed: the launcher must stop the router and the other replica and exit with status 1.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import free_port

pytestmark = pytest.mark.slow

smg = pytest.importorskip("smg", reason="the router package `smg` is not installed")

from radixlm.server.data_parallel import (  # noqa: E402
    DataParallelConfig,
    router_argv,
)
from radixlm.server.server_config import ServerConfig  # noqa: E402

API_KEY = "dp-secret"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NUM_CONVERSATIONS = 3
TURNS = 3
STARTUP_TIMEOUT_S = 240


@dataclass
class Cluster:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    worker_urls: list[str]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


def _system_prompts() -> list[str]:
    rng = random.Random(0)
    words = (
        "river stone cloud maple copper lantern orbit harbor velvet meadow signal quartz".split()
    )
    return [
        f"You are assistant number {i}. Facts you know: "
        + " ".join(rng.choice(words) for _ in range(110))
        for i in range(NUM_CONVERSATIONS)
    ]


def _wait(check: Any, proc: subprocess.Popen[bytes], what: str, log: Any) -> Any:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log()}")
        try:
            result = check()
            if result:
                return result
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{what} not ready after {STARTUP_TIMEOUT_S} s:\n{log()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[Cluster]:
    log_path = tmp_path_factory.mktemp("dp") / "launcher.log"
    port = free_port()
    env = {**os.environ, "RADIXLM_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "radixlm.cli", "serve", "--dp-size", "2",
        "--host", "127.0.0.1", "--port", str(port), "--model", str(tiny_llama_dir),
        "--dtype", "float32",
        "--num-threads", "1", "--num-pages", "256", "--log-level", "warning",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    cl = Cluster(url, proc, log_path, [])

    def workers() -> list[str] | None:
        body = httpx.get(f"{url}/workers", headers=HEADERS, timeout=5).json()
        urls = [w["url"] for w in body.get("workers", []) if w.get("is_healthy")]
        return urls if len(urls) == 2 else None

    try:
        cl.worker_urls = _wait(workers, proc, "the launcher", cl.log)
        yield cl
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cache_counters(worker_urls: list[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for u in worker_urls:
        s = httpx.get(f"{u}/get_server_info", headers=HEADERS, timeout=30).json()["engine_stats"]
        out[u] = (s["cache_hit_tokens"], s["cache_queried_tokens"])
    return out


def _flush(worker_urls: list[str]) -> None:
    for u in worker_urls:
        r = httpx.post(f"{u}/flush_cache", headers=HEADERS, timeout=30)
        assert r.status_code == 200, r.text


def _run_workload(url: str, worker_urls: list[str]) -> tuple[float, list[int]]:
    """Interleaved conversations through `url`; returns the replicas' radix-cache hit rate over
    the run and each request's `cached_tokens`."""
    prompts = _system_prompts()
    models = httpx.get(f"{worker_urls[0]}/v1/models", headers=HEADERS, timeout=30).json()
    model = models["data"][0]["id"]
    before = _cache_counters(worker_urls)
    cached = []
    with httpx.Client(base_url=url, headers=HEADERS, timeout=180) as client:
        for turn in range(TURNS):
            for conv, system in enumerate(prompts):
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"Question {turn} of conversation {conv}?"},
                    ],
                    "max_tokens": 1,
                    "temperature": 0.0,
                }
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = _cache_counters(worker_urls)
    hits = sum(after[u][0] - before[u][0] for u in worker_urls)
    queried = sum(after[u][1] - before[u][1] for u in worker_urls)
    return hits / queried, cached


def test_worker_discovery(cluster: Cluster) -> None:
    """The router identifies every replica as an SGLang HTTP worker and reads its metadata."""
    body = httpx.get(f"{cluster.url}/workers", headers=HEADERS, timeout=10).json()
    for w in body["workers"]:
        assert w["runtime_type"] == "sglang"
        assert w["connection_mode"] == "http"
        assert w["labels"]["dp_size"] == "1"
        assert w["labels"]["tp_size"] == "1"
        assert int(w["labels"]["max_total_tokens"]) == 256 * 16
        assert w["models"][0]["architectures"] == ["LlamaForCausalLM"]


def test_native_generate_through_router(cluster: Cluster) -> None:
    """The router forwards SGLang's full /generate shape (`model`, `log_metrics`, ...)."""
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(f"{cluster.url}/generate", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4
    # Authentication still holds at the router's front door.
    r = httpx.post(f"{cluster.url}/generate", json=body, timeout=30)
    assert r.status_code == 401


def test_cache_aware_keeps_prefixes_on_one_replica(cluster: Cluster, tmp_path: Path) -> None:
    urls = cluster.worker_urls
    _flush(urls)
    aware, aware_cached = _run_workload(cluster.url, urls)

    # Same replicas behind a second router that ignores the cache.
    _flush(urls)
    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, api_key=API_KEY, log_level="warning")
    argv = router_argv(config, DataParallelConfig(dp_size=2, policy="round_robin"), urls)
    log_path = tmp_path / "rr_router.log"
    with open(log_path, "wb") as log:
        rr = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        rr_url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            body = httpx.get(f"{rr_url}/workers", headers=HEADERS, timeout=5).json()
            return sum(bool(w.get("is_healthy")) for w in body.get("workers", [])) == 2

        _wait(ready, rr, "the round-robin router", lambda: log_path.read_text(errors="replace"))
        round_robin, _ = _run_workload(rr_url, urls)
    finally:
        rr.send_signal(signal.SIGTERM)
        rr.wait(timeout=30)

    _flush(urls)
    single, single_cached = _run_workload(urls[0], urls)

    print(
        f"hit rate: one replica {single:.3f}, cache_aware {aware:.3f}, "
        f"round_robin {round_robin:.3f}"
    )
    # Every prefix computed once: after its first request, a conversation hits the whole
    # system prompt, exactly as on one replica.
    assert aware_cached[NUM_CONVERSATIONS:] == single_cached[NUM_CONVERSATIONS:]
    assert min(aware_cached[NUM_CONVERSATIONS:]) >= 112
    assert abs(aware - single) < 0.03
    assert aware > round_robin + 0.1


def test_dead_replica_stops_everything(cluster: Cluster) -> None:
    """Killing one replica takes the launcher, the router and the other replica down, status 1."""
    victim = int(cluster.worker_urls[0].rsplit(":", 1)[1])
    pids = subprocess.run(
        ["pgrep", "-f", f"radixlm.cli serve --host 127.0.0.1 --port {victim} "],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(pids) == 1, pids
    os.kill(int(pids[0]), signal.SIGKILL)
    assert cluster.process.wait(timeout=60) == 1
    assert "exited with status -9" in cluster.log()
    for url in [cluster.url, *cluster.worker_urls]:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
