"""Schemas beyond context-free grammars on the real default model: random schemas built from
the keywords only the verifier enforces; every output that finishes validates (jsonschema)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm import Engine, SamplingParams
from radixlm.tool_calls import parse_tool_calls

pytestmark = pytest.mark.slow
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

# The generator is shared with ``benchmarks/bench_verifier.py --random`` (a larger run).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_loader import load_benchmark  # noqa: E402

random_schema = load_benchmark("random_schemas").random_schema
verified_schemas = st.randoms(use_true_random=False).map(random_schema)
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> Iterator[Engine]:
    e = Engine(str(default_model_dir), dtype="float32", num_pages=256, grammar_timeout_s=300.0)
    yield e
    e.shutdown()


# One job: a schema, greedy (temperature 0) or seeded sampling.
jobs = st.tuples(verified_schemas, st.sampled_from([0.0, 0.8, 1.0]),
                 st.integers(min_value=0, max_value=2**16))  # fmt: skip


def _stopped(r: Any, tokenizer: Any) -> bool:
    """True when the generation finished with "stop". Else it was cut by ``max_tokens``
    ("length": exactly that many tokens) or ended at a dead end (the exact schema refused
    every continuation: ``grammar_dead_end``), never another error. Either way the text the
    client was streamed (``GenerateResult.text`` joins the deltas) is the final output's:
    no rolled-back token was released."""
    out = r.outputs[0]
    assert r.finish_reason in ("stop", "length", "error"), r.finish_reason
    if r.finish_reason == "error":
        assert out.error_code == "grammar_dead_end", r.error
    if r.finish_reason == "length":
        assert len(out.output_token_ids) == MAX_TOKENS
    assert r.text == tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    return r.finish_reason == "stop"


def _validate(schema: dict[str, Any], value: Any) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(value)


@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI never flakes on a new draw
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(jobs, min_size=6, max_size=6))
def test_outputs_of_random_verified_schemas_validate(
    engine: Engine, tokenizer: Any, batch: list[tuple[dict[str, Any], float, int]]
) -> None:
    """Random schemas (``benchmarks/random_schemas.py``) in one batch of six, greedy and
    seeded sampling: every output that finishes with "stop" validates with ``jsonschema``."""
    prompts, params = [], []
    for schema, temperature, seed in batch:
        ask = f"Write one JSON value that matches this JSON schema:\n{json.dumps(schema)}"
        prompts.append(engine.apply_chat_template([{"role": "user", "content": ask}]))
        params.append(SamplingParams(max_new_tokens=MAX_TOKENS, temperature=temperature,
                                     seed=seed, constraint={"json_schema": schema}))  # fmt: skip
    results = engine.generate(prompts, params)
    for (schema, _, _), r in zip(batch, results):
        if _stopped(r, tokenizer):
            _validate(schema, json.loads(r.text))


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(jobs, min_size=4, max_size=4))
def test_tool_arguments_of_random_verified_schemas_validate(
    engine: Engine, tokenizer: Any, batch: list[tuple[dict[str, Any], float, int]]
) -> None:
    """The same schemas as a tool's ``parameters`` (the ``tool_calls`` constraint): every
    finished call's arguments validate."""
    prompts, params = [], []
    for schema, temperature, seed in batch:
        spec = {"mode": "required", "parallel": False,
                "tools": [{"name": "record", "parameters": schema}]}  # fmt: skip
        ask = f"Call record with arguments matching this JSON schema:\n{json.dumps(schema)}"
        prompts.append(engine.apply_chat_template([{"role": "user", "content": ask}]))
        params.append(SamplingParams(max_new_tokens=MAX_TOKENS, temperature=temperature,
                                     seed=seed, constraint={"tool_calls": spec}))  # fmt: skip
    results = engine.generate(prompts, params)
    for (schema, _, _), r in zip(batch, results):
        if _stopped(r, tokenizer):
            [call] = parse_tool_calls(r.text).calls
            assert call.name == "record"
            _validate(schema, call.args)
