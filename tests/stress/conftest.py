"""tests/stress: hostile input, load, faults and shutdown against a real `radixlm serve` process
on loopback, running a tiny random-weight Llama (float32) through `fault_server.py` (the CLI
plus fault-injection hooks keyed by request seeds; see that file).

The shared server has a small KV pool (STRESS_PAGES pages of 4 tokens) so that load forces
retraction, and short grammar / request timeouts so that every wait in these tests is bounded;
`--max-model-len 64` bounds every generation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import Server, launch_server
from stress_support import FAULT_SERVER, STRESS_ARGS


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
