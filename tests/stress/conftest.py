"""tests/stress: hostile input, load, faults and shutdown against a real `radixlm serve` process
on loopback, running a tiny random-weight Llama (float32) through `fault_server.py` (the CLI
plus fault-injection hooks keyed by request seeds; see that file).

The shared server has a small KV pool (STRESS_PAGES pages of 16 tokens) so that load forces
retraction, and short grammar / request timeouts so that every wait in these tests is bounded;
`--max-model-len 64` bounds every generation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Server, launch_server

FAULT_SERVER = [str(Path(__file__).with_name("fault_server.py"))]
STRESS_PAGES = 24
STRESS_ARGS = [
    "--num-pages", str(STRESS_PAGES),
    "--max-running-requests", "32",
    "--max-n", "4",
    "--max-model-len", "64",  # bounds every generation: fuzzed requests finish fast
    "--grammar-timeout-s", "2",
    "--request-timeout", "60",
    "--max-queued-requests", "4096",
]  # fmt: skip


@pytest.fixture(scope="session")
def stress_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("stress") / "server.log"
    if os.environ.get("RADIXLM_STRESS_URL"):  # development: reuse a running fault_server.py
        yield Server(os.environ["RADIXLM_STRESS_URL"], "", None, log_path)  # type: ignore[arg-type]
        return
    with launch_server(tiny_llama_dir, log_path, "", STRESS_ARGS, entry=FAULT_SERVER) as srv:
        yield srv


@pytest.fixture(scope="session")
def http(stress_server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stress_server.url, timeout=60) as client:
        yield client


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
