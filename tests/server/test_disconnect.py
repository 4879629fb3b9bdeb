"""Clients that go away mid-request: their requests are aborted and their KV pages released."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

NUM_CLIENTS = 16
LONG_OUTPUT = 1000  # far more than the test waits for


async def _stream_then_disconnect(url: str, headers: dict[str, str], k: int) -> int:
    """Open a stream, read a few events, then drop the connection."""
    body = {
        "prompt": f"Client {k} counts slowly: one, two,",
        "max_tokens": LONG_OUTPUT,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": k,
        "stream": True,
    }
    events = 0
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events >= 3:
                        break
    return events


def test_streaming_clients_disconnect_mid_stream(server):
    async def main() -> list[int]:
        return await asyncio.gather(
            *(_stream_then_disconnect(server.url, server.headers, k) for k in range(NUM_CLIENTS))
        )

    before = server.info()["engine_stats"]["generated_tokens"]
    t0 = time.monotonic()
    events = asyncio.run(main())
    assert events == [3] * NUM_CLIENTS
    info = server.wait_idle(timeout=30)
    elapsed = time.monotonic() - t0
    stats = info["engine_stats"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_pages_used"] == 0, stats
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
    assert info["kv_integrity"] == "ok" and info["active_requests"] == 0
    # aborted, not run to completion: 16 x 1000 tokens would take minutes on CPU
    assert stats["generated_tokens"] - before < NUM_CLIENTS * LONG_OUTPUT // 4
    assert elapsed < 60


def test_non_streaming_client_disconnect_aborts(server):
    before = server.info()["engine_stats"]["generated_tokens"]
    body = {"prompt": "Once upon a time", "max_tokens": LONG_OUTPUT, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        # Nothing is sent until the end: the read times out after 3 s (the connect may be slow).
        url, limits = f"{server.url}/v1/completions", httpx.Timeout(30.0, read=3.0)
        httpx.post(url, json=body, headers=server.headers, timeout=limits)
    info = server.wait_idle(timeout=15)
    generated = info["engine_stats"]["generated_tokens"] - before
    assert 0 < generated < LONG_OUTPUT
    assert info["engine_stats"]["kv_pages_used"] == 0 and info["kv_integrity"] == "ok"
