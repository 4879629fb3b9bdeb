"""Start a real `radixlm serve` subprocess on a free loopback port (shared by tests/server and
tests/lang): it runs with 1 thread, float32 and an API key passed through `RADIXLM_API_KEY`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

STARTUP_TIMEOUT_S = 180


@dataclass
class Server:
    url: str
    api_key: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def info(self) -> dict[str, Any]:
        r = httpx.get(
            f"{self.url}/get_server_info",
            params={"check_integrity": "true"},
            headers=self.headers,
            timeout=30,
        )
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Poll until the engine has no running or waiting request; return the server info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            s = info["engine_stats"]
            if s["num_running"] == 0 and s["num_waiting"] == 0 and info["active_requests"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout} s: {info}")
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launch_server(
    model_dir: Path,
    log_path: Path,
    api_key: str,
    extra_args: list[str],
    entry: list[str] | None = None,
) -> Iterator[Server]:
    """Start the server, wait for /health, yield it, and stop it (SIGTERM, then kill).
    `entry`: what follows the Python executable instead of `-m radixlm.cli` (a script that
    wraps the CLI, e.g. with test hooks)."""
    port = free_port()
    env = {
        **os.environ,
        "RADIXLM_API_KEY": api_key,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable, *(entry or ["-m", "radixlm.cli"]), "serve",
        "--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir),
        "--num-threads", "1", "--dtype", "float32", "--log-level", "warning", *extra_args,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port}", api_key, proc, log_path)
    try:
        _wait_ready(srv)
        yield srv
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(srv: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if srv.process.poll() is not None:
            pytest.fail(f"server exited with {srv.process.returncode}:\n{srv.log()}")
        try:
            if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{srv.log()}")
