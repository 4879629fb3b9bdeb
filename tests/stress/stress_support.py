"""Helpers shared by tests/stress (imported by name: a conftest cannot be imported when
several test directories are collected together)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from live_server import Server

FAULT_SERVER = [str(Path(__file__).with_name("fault_server.py"))]
STRESS_PAGES = 64  # of 4 tokens: 256 tokens for up to 32 running requests of ~40 tokens
STRESS_ARGS = [
    "--num-pages", str(STRESS_PAGES),
    "--page-size", "4",
    "--max-running-requests", "32",
    "--max-n", "4",
    "--max-model-len", "64",  # bounds every generation: fuzzed requests finish fast
    "--grammar-timeout-s", "2",
    "--request-timeout", "60",
    "--max-queued-requests", "4096",
]  # fmt: skip


def assert_clean(server: Server, timeout: float = 30.0) -> dict[str, Any]:
    """The engine is idle, holds no KV page, and its page accounting checks out."""
    info = server.wait_idle(timeout)
    s = info["engine_stats"]
    assert info["kv_integrity"] == "ok", info["kv_integrity"]
    assert s["kv_pages_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert info["engine_alive"] is True
    return info


def normal_request(http: httpx.Client) -> None:
    """A plain request that must succeed (the server keeps serving)."""
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def wait_exit(server: Server, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            return code
        time.sleep(0.05)
    raise AssertionError(f"server still running after {timeout} s:\n{server.log()}")
