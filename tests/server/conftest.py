"""One real `radixlm serve` process for all of tests/server (the default model, float32, CPU).

The server runs with an API key (given through `RADIXLM_API_KEY`, so the env path is covered),
`--max-n 8` (for the "n beyond the configured limit" case) and a KV pool of 384 pages of 16
tokens (6144 tokens) with chunked prefill off: a prompt of more than 6144 tokens still fits the
8192-token context, passes validation, and then fails inside the engine at admission, without
being computed. That is how the tests provoke an engine-side failure of one request.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

API_KEY = "test-secret-key"
NUM_PAGES = 384
MAX_N = 8
STARTUP_TIMEOUT_S = 180


@dataclass
class Server:
    url: str
    api_key: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def info(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/get_server_info", headers=self.headers, timeout=30)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {
        **os.environ,
        "RADIXLM_API_KEY": API_KEY,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable, "-m", "radixlm.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(default_model_dir),
        "--num-threads", "1", "--dtype", "float32",
        "--num-pages", str(NUM_PAGES), "--chunked-prefill-size", "0",
        "--max-n", str(MAX_N), "--log-level", "warning",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(f"http://127.0.0.1:{port}", API_KEY, proc, log_path)
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


@pytest.fixture(scope="session")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def oai(server: Server) -> Any:
    import openai

    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120
    )


@pytest.fixture(scope="session")
def model_name(oai: Any) -> str:
    return oai.models.list().data[0].id


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from radixlm.runtime.models.loader import load_tokenizer

    return load_tokenizer(default_model_dir)
