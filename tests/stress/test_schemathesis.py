"""Schemathesis against the server's own OpenAPI schema: a bounded number of generated cases
per endpoint (schema-valid and schema-violating ones); no 5xx, and every 4xx carries an
OpenAI-style error body with a message. Afterwards the engine is clean."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from live_server import Server
from stress_support import assert_clean, normal_request

MAX_EXAMPLES = 20  # per endpoint (positive and negative generation modes together)


def _check(case: Any, failures: list[str]) -> None:
    response = case.call(timeout=60)
    status = response.status_code
    where = f"{case.method} {case.path}"
    if status >= 500:
        failures.append(f"{where}: {status} {response.text[:300]} <- {case.body!r:.300}")
    elif status >= 400:
        try:
            error = response.json()["error"]
            assert isinstance(error, dict) and error["message"]
        except Exception:  # noqa: BLE001 - any shape problem is the failure
            failures.append(f"{where}: {status} without an error body: {response.text[:300]}")


def _fuzz(op: Any, tried: dict[str, int], failures: list[str]) -> None:
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(case=op.as_strategy())
    def run(case: Any) -> None:
        tried[op.label] = tried.get(op.label, 0) + 1
        _check(case, failures)

    run()


def test_generated_cases(stress_server: Server, http: Any) -> None:
    config = schemathesis.Config.from_dict({"generation": {"mode": "all"}})
    schema = schemathesis.openapi.from_url(f"{stress_server.url}/openapi.json", config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    failures: list[str] = []
    tried: dict[str, int] = {}
    for op in operations:
        _fuzz(op, tried, failures)
    print(f"schemathesis: {sum(tried.values())} cases over {len(tried)} endpoints: {tried}")
    assert not failures, "\n".join(failures[:20])
    normal_request(http)
    assert_clean(stress_server)
