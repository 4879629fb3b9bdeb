"""Backends for the frontend tests on the real default model (float32, CPU, one thread).

`runtime`: one in-process `Runtime` for the session. `endpoint`: a `RuntimeEndpoint` to a real
`radixlm serve` subprocess (with an API key), started on first use. `backend` is parametrized
over both, so every e2e program runs on each.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import launch_server

import radixlm as sgl

API_KEY = "lang-test-key"
NUM_PAGES = 1024  # 16k tokens of KV per backend


@pytest.fixture(scope="session")
def runtime(default_model_dir: Path) -> Iterator[Any]:
    rt = sgl.Runtime(
        model_path=str(default_model_dir), dtype="float32", num_threads=1, num_pages=NUM_PAGES
    )
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("lang_server") / "server.log"
    with launch_server(
        default_model_dir, log_path, API_KEY, ["--num-pages", str(NUM_PAGES)]
    ) as srv:
        yield srv.url


@pytest.fixture(scope="session")
def endpoint(server_url: str) -> Iterator[Any]:
    ep = sgl.RuntimeEndpoint(server_url, api_key=API_KEY)
    yield ep
    ep.shutdown()


@pytest.fixture(params=["runtime", "endpoint"])
def backend(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)
