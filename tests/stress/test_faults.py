"""Faults injected through `fault_server.py`'s hooks: an exception in one request's sampling,
grammar, detokenization or scheduling, or in a forward its prompt is part of, fails that
request only (the others in flight finish with the output they get alone); a compile timeout
is a 503 with the reason; over-long prompts are 400s; a deadline aborts a request (408) and
frees its pages; a full queue is a 503 with Retry-After; the engine thread dying makes /health
fail and the process exit 1; SIGTERM lets short requests finish, fails the rest with a clear
error and exits 0. Nothing leaks."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fault_server import DETOK, DIE, FORWARD, GRAMMAR, SAMPLE, SCHEDULE, SLOW
from live_server import Server, launch_server
from stress_support import FAULT_SERVER, assert_clean, normal_request, wait_exit

C, G = "/v1/completions", "/generate"
SP2 = {"max_new_tokens": 2}
GOOD = [f"Request number {k} says" for k in range(4)]


def _good(k: int) -> dict[str, Any]:
    return {"prompt": GOOD[k], "max_tokens": 12, "temperature": 0, "ignore_eos": True}


async def _post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(path, json=body)


def _concurrently(server: Server, bad: tuple[str, dict[str, Any]]) -> list[httpx.Response]:
    """The bad request and four good ones at once (the bad one in the middle)."""

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            calls = [_post(client, C, _good(k)) for k in range(4)]
            calls.insert(2, _post(client, *bad))
            return await asyncio.gather(*calls)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def solo(http: httpx.Client) -> list[str]:
    """The good requests' texts when each runs alone."""
    return [http.post(C, json=_good(k)).json()["choices"][0]["text"] for k in range(4)]


BAD_REQUESTS = {
    "sampling": (C, {"prompt": "Hi", "max_tokens": 4, "seed": SAMPLE}, "injected sampling fault"),
    "grammar": (
        C,
        {"prompt": "Hi", "max_tokens": 4, "seed": GRAMMAR, "regex": "[a-z]+"},
        "injected grammar fault",
    ),
    "detokenizer": (C, {"prompt": "Hi", "max_tokens": 4, "seed": DETOK}, "injected detokenizer"),
    "forward": (
        G,
        {"input_ids": [5, *FORWARD, 7], "sampling_params": {"max_new_tokens": 4}},
        "injected forward fault",
    ),
    "scheduling": (
        G,
        {"input_ids": [5, *SCHEDULE, 7], "sampling_params": {"max_new_tokens": 4}},
        "injected scheduling fault",
    ),
}


@pytest.mark.parametrize("fault", list(BAD_REQUESTS))
def test_fault_fails_only_its_request(
    stress_server: Server, http: httpx.Client, solo: list[str], fault: str
) -> None:
    path, body, message = BAD_REQUESTS[fault]
    responses = _concurrently(stress_server, (path, body))
    bad = responses.pop(2)
    assert bad.status_code == 500, bad.text
    assert message in bad.json()["error"]["message"]
    for k, r in enumerate(responses):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == solo[k]
    normal_request(http)
    assert_clean(stress_server)


def test_fault_in_a_stream_ends_it_with_an_error_event(
    stress_server: Server, http: httpx.Client
) -> None:
    body = {"prompt": "Hi", "max_tokens": 4, "seed": DETOK, "stream": True}
    with http.stream("POST", C, json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert "injected detokenizer fault" in error["message"]
    normal_request(http)
    assert_clean(stress_server)


def test_compile_timeout_is_a_503_with_the_reason(
    stress_server: Server, http: httpx.Client
) -> None:
    t0 = time.monotonic()
    slow = f"SLOW{uuid.uuid4().hex[:8]}[0-9]"  # fresh: a finished late compile is cached
    r = http.post(C, json={"prompt": "Hi", "max_tokens": 3, "regex": slow})
    elapsed = time.monotonic() - t0
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "grammar_timeout" and "--grammar-timeout-s" in error["message"]
    assert r.headers["Retry-After"] == "1"
    assert elapsed < 4.5, elapsed  # bounded by the 2 s grammar timeout, not the 5 s compile
    r = http.post(C, json={"prompt": "Hi", "max_tokens": 3, "regex": "[0-9]+"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].isdigit()
    assert_clean(stress_server)


def test_over_long_prompts_are_400(stress_server: Server, http: httpx.Client) -> None:
    r = http.post(C, json={"prompt": "hello " * 100, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    r = http.post(C, json={"prompt": "x" * 10_000, "max_tokens": 2})
    assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"]
    r = http.post(G, json={"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
    normal_request(http)
    assert_clean(stress_server)


def test_deadline_aborts_and_frees_pages(stress_server: Server, http: httpx.Client) -> None:
    # 50 ms per step: the 60 tokens take 3 s however fast the machine, past the 0.2 s deadline.
    body = {"prompt": "Hi", "max_tokens": 60, "ignore_eos": True, "timeout": 0.2, "seed": SLOW}
    r = http.post(C, json=body)
    assert r.status_code == 408, r.text
    assert r.json()["error"]["param"] == "timeout"
    with http.stream("POST", C, json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
    normal_request(http)
    assert_clean(stress_server)


def test_batch_ids_are_unique_and_abort_one(stress_server: Server, http: httpx.Client) -> None:
    long_sp = {"max_new_tokens": 50, "ignore_eos": True, "seed": SLOW}  # >= 2.5 s in flight

    async def in_flight(client: httpx.AsyncClient, n: int) -> None:
        for _ in range(600):
            if (await client.get("/get_load")).json()[0]["num_reqs"] >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the batch never reached the engine")

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=stress_server.url, timeout=60) as client:
            batch = asyncio.ensure_future(
                client.post(G, json={"text": ["a", "b"], "rid": "job", "sampling_params": long_sp})
            )
            await in_flight(client, 2)
            clash = await client.post(G, json={"text": "c", "rid": "job-1", "sampling_params": SP2})
            abort = await client.post("/abort_request", json={"rid": "job-0"})
            return await batch, clash, abort

    batch, clash, abort = asyncio.run(main())
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "rid"
    assert abort.json() == {"success": True, "found": True}
    reasons = [item["meta_info"]["finish_reason"]["type"] for item in batch.json()]
    assert reasons == ["abort", "length"], batch.json()
    assert_clean(stress_server)


# ---- own servers: the queue bound, engine-thread death, SIGTERM ------------------------------


@pytest.fixture
def small_server(tmp_path: Path, tiny_llama_dir: Path) -> Iterator[Server]:
    args = [
        "--max-running-requests", "1", "--max-queued-requests", "2",
        "--shutdown-timeout", "2", "--max-model-len", "512",
    ]  # fmt: skip
    with launch_server(tiny_llama_dir, tmp_path / "server.log", "", args, FAULT_SERVER) as srv:
        yield srv


def _long(k: int) -> dict[str, Any]:
    """A stream that stays in flight for seconds on any machine (50 ms per step)."""
    body = {"prompt": f"Long {k}", "max_tokens": 400, "ignore_eos": True, "stream": True}
    return {**body, "seed": SLOW}


async def _wait_load(client: httpx.AsyncClient, reqs: int, waiting: int) -> None:
    """Until the engine holds `reqs` requests, `waiting` of them queued (polled, not slept:
    CI is slow)."""
    for _ in range(1000):
        load = (await client.get("/get_load")).json()[0]
        if load["num_reqs"] == reqs and load["num_waiting_reqs"] == waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine never held {reqs} requests ({waiting} waiting): {load}")


def test_queue_bound_and_sigterm(small_server: Server) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as client:
            # One runs, then two wait: the queue is full. (Sent together, the third could find
            # all three still queued and be refused.)
            streams = [asyncio.ensure_future(_stream_events(client, _long(0)))]
            await _wait_load(client, reqs=1, waiting=0)
            streams += [asyncio.ensure_future(_stream_events(client, _long(k))) for k in (1, 2)]
            await _wait_load(client, reqs=3, waiting=2)
            r = await client.post(C, json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert "--max-queued-requests" in r.json()["error"]["message"]
            small_server.process.send_signal(signal.SIGTERM)
            for _ in range(500):  # the signal is handled between event-loop callbacks
                health = await client.get("/health")
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.01)
            assert health.status_code == 503, health.text
            r = await client.post(C, json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            results = await asyncio.gather(*streams)
            # Each stream ends with the shutting_down error (400 steps of 50 ms cannot finish
            # within the 2 s shutdown timeout); a finished stream would have to end by length.
            ends = []
            for events in results:
                last = events[-1]
                if "error" in last:
                    assert last["error"]["code"] == "shutting_down", last
                    ends.append("shutting_down")
                else:
                    reasons = [c.get("finish_reason") for e in events for c in e.get("choices", [])]
                    assert "length" in reasons, events[-3:]
                    ends.append("length")
            assert "shutting_down" in ends, results

    asyncio.run(main())
    assert wait_exit(small_server, 30) == 0, small_server.log()


async def _stream_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    async with client.stream("POST", C, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_engine_thread_death_fails_health_and_exits_1(small_server: Server) -> None:
    http = httpx.Client(base_url=small_server.url, timeout=30)
    r = http.post(C, json={"prompt": "Hi", "max_tokens": 2, "seed": DIE})
    assert r.status_code in (500, 503), r.text
    assert "injected engine-thread death" in r.json()["error"]["message"]
    code = wait_exit(small_server, 30)
    assert code == 1
    log = small_server.log()
    assert "injected engine-thread death" in log and "the engine thread died" in log
