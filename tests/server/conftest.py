"""One real `radixlm serve` process for all of tests/server (the default model, float32, CPU).

The server runs with an API key (given through `RADIXLM_API_KEY`, so the env path is covered),
`--max-n 8` (for the "n beyond the configured limit" case) and a KV pool of 384 pages of 16
tokens (6144 tokens) with chunked prefill off: a prompt of more than 6144 tokens still fits the
8192-token context, passes validation, and then fails inside the engine at admission, without
being computed. That is how the tests provoke an engine-side failure of one request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Server, launch_server

API_KEY = "test-secret-key"
NUM_PAGES = 384
MAX_N = 8


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    extra = ["--num-pages", str(NUM_PAGES), "--chunked-prefill-size", "0", "--max-n", str(MAX_N)]
    with launch_server(default_model_dir, log_path, API_KEY, extra) as srv:
        yield srv


@pytest.fixture(scope="session")
def num_pages() -> int:
    """The server's KV pool in pages (a fixture: `from conftest import` could find another
    test directory's conftest when several are collected together)."""
    return NUM_PAGES


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
