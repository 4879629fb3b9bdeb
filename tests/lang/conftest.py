"""Backends for the frontend tests on the real default model (float32, CPU, one thread).

`runtime`: one in-process `Runtime` for the session. `endpoint`: a `RuntimeEndpoint` to a real
`radixlm serve` subprocess (with an API key), started on first use. `backend` is parametrized
over both, so every e2e program runs on each.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import radixlm as sgl

API_KEY = "lang-test-key"
NUM_PAGES = 1024  # 16k tokens of KV per backend
STARTUP_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def runtime(default_model_dir: Path) -> Iterator[Any]:
    rt = sgl.Runtime(
        model_path=str(default_model_dir), dtype="float32", num_threads=1, num_pages=NUM_PAGES
    )
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[str]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("lang_server") / "server.log"
    env = {
        **os.environ,
        "RADIXLM_API_KEY": API_KEY,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    cmd = [
        sys.executable, "-m", "radixlm.cli", "serve",
        "--host", "127.0.0.1", "--port", str(port), "--model", str(default_model_dir),
        "--num-threads", "1", "--dtype", "float32", "--num-pages", str(NUM_PAGES),
        "--log-level", "warning",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in {STARTUP_TIMEOUT_S} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def endpoint(server_url: str) -> Iterator[Any]:
    ep = sgl.RuntimeEndpoint(server_url, api_key=API_KEY)
    yield ep
    ep.shutdown()


@pytest.fixture(params=["runtime", "endpoint"])
def backend(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)
