"""`/dashboard`: the public page, the key-protected SSE stream and snapshot, live payloads,
and `--dashboard-show-text` (in process, on a tiny model)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from radixlm.server.metrics import RecentWindow

SYSTEM = (
    "You are the booking assistant of the Quetzalcoatl Ferry Company. Answer in one short "
    "sentence, name the pier, and never promise a refund. "
)


def chat(http: httpx.Client, user: str) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        },
    )
    r.raise_for_status()


def shared_prefix_tokens(tokenizer: Any, page_size: int = 16) -> int:
    """Page-aligned tokens that two chats with this system prompt share (a tree node ends there)."""
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}],
            tokenize=True,
            add_generation_prompt=True,
        )
        for u in ("Where is the pier?", "How late is the last boat?")
    ]
    ids = [x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x for x in ids]
    n = 0
    while ids[0][n] == ids[1][n]:
        n += 1
    return n // page_size * page_size


def read_events(server, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "GET", f"{server.url}/dashboard/stream", headers=server.headers, timeout=timeout
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = b""
        for chunk in r.iter_bytes():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                assert event.startswith(b"data: ")
                events.append(orjson.loads(event[6:]))
                if len(events) == n:
                    return events
    raise AssertionError(f"stream ended after {len(events)} events")


def test_page_and_static_files_are_public(server) -> None:
    r = httpx.get(f"{server.url}/dashboard", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/dashboard/static/dashboard.js" in r.text
    for name in ("dashboard.js", "dashboard.css"):
        assert httpx.get(f"{server.url}/dashboard/static/{name}", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/dashboard/static/nope.js", timeout=30).status_code == 404


@pytest.mark.parametrize("path", ["/dashboard/stream", "/dashboard/snapshot"])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_data_needs_the_api_key(server, path: str, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{server.url}{path}", headers=headers, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_stream_sends_a_payload_about_every_second(server, http, tokenizer) -> None:
    server.wait_idle()
    assert http.post("/flush_cache").status_code == 200
    chat(http, "Where is the pier?")
    chat(http, "How late is the last boat?")
    t0 = time.monotonic()
    first, second, third = read_events(server, 3)
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 10, elapsed
    assert "history" in first and "history" not in second and "history" not in third
    assert third["point"]["t"] > second["point"]["t"]
    for ev in (first, second, third):
        m = ev["memory"]
        assert m["free_pages"] + m["held_pages"] + m["cached_pages"] == m["total_pages"]
        assert ev["scheduler"]["num_running"] == 0 and ev["scheduler"]["requests"] == []
    rates, tree = third["rates"], third["tree"]
    assert rates["hit_rate_total"] > 0 and rates["ttft_count"] >= 2
    assert rates["ttft_p50"] <= rates["ttft_p99"]
    expected = shared_prefix_tokens(tokenizer)
    shared = [n for n in tree["nodes"] if n["prefix_tokens"] == expected]
    assert len(shared) == 1, [(n["prefix_tokens"], n["tokens"]) for n in tree["nodes"]]
    assert shared[0]["hits"] >= 1 and shared[0]["state"] == "evictable"
    assert len(shared[0]["key_hash"]) == 8 and "text" not in shared[0]
    raw = orjson.dumps(third).decode()
    assert "Quetzalcoatl" not in raw and "pier" not in raw, "prompt text leaked"
    assert third["viewers"] == 1
    # The stream is closed: the hub forgets the viewer (and stops sampling).
    deadline = time.monotonic() + 10
    while http.get("/dashboard/snapshot").json()["viewers"] != 0:
        assert time.monotonic() < deadline, "the closed stream's viewer was never dropped"
        time.sleep(0.2)


def test_recent_window_percentiles() -> None:
    w = RecentWindow(window_s=60.0)
    for i in range(1, 101):
        w.add(float(i), now=1000.0)
    p = w.percentiles(now=1000.0)
    assert (p.count, p.p50, p.p99) == (100, 50.0, 99.0)
    w.add(7.0, now=1050.0)
    assert w.percentiles(now=1070.0).count == 1  # the first 100 fell out of the window
    assert w.percentiles(now=1200.0).p50 is None


@pytest.mark.parametrize("show_text", [False, True])
def test_show_text_only_with_the_flag(tiny_llama_dir: Path, show_text: bool) -> None:
    from radixlm import Engine, SamplingParams
    from radixlm.server import ServerConfig, create_app

    engine = Engine(str(tiny_llama_dir), dtype="float32", num_pages=64, page_size=4, num_threads=1)
    try:
        prefix = "The secret harbour code is "
        params = SamplingParams(max_new_tokens=2, temperature=0)
        engine.generate([prefix + "alpha bravo", prefix + "charlie delta"], params)
        assert engine.wait_idle(timeout=30)
        app = create_app(engine, ServerConfig(dashboard_show_text=show_text))

        async def get() -> dict[str, Any]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await c.get("/dashboard/snapshot")
                assert r.status_code == 200
                return r.json()

        body = asyncio.run(get())
    finally:
        engine.shutdown()
    nodes = [n for n in body["tree"]["nodes"] if n["state"] != "root"]
    assert nodes and body["show_text"] is show_text
    texts = "".join(n.get("text", "") for n in nodes)
    if show_text:
        assert "secret harbour" in texts
    else:
        assert texts == "" and "harbour" not in orjson.dumps(body).decode()
