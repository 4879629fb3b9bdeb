"""`Engine.submit` is the one validation point: everything that can reach the step loop is
checked there and refused with a `RequestValidationError` naming the field, nothing queued;
stats are O(1) reads that never wait for the engine lock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixlm import Engine, SamplingParams
from radixlm.runtime.errors import EngineDeadError, RequestValidationError


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    with Engine(str(tiny_llama_dir), dtype="float32", num_pages=64, max_model_len=128) as eng:
        yield eng


@pytest.mark.parametrize(
    ("prompt", "params", "field", "code"),
    [
        ([], SamplingParams(), "prompt", None),
        ("", SamplingParams(), "prompt", None),
        ([49152], SamplingParams(), "prompt", None),
        ([5, -1], SamplingParams(), "prompt", None),
        ([5] * 128, SamplingParams(), "prompt", "context_length_exceeded"),
        ("Hi", SamplingParams(min_new_tokens=1, stop_token_ids=[49152]), "stop_token_ids", None),
        ("Hi", SamplingParams(logit_bias={49152: 1.0}), "logit_bias", None),
        ("Hi", SamplingParams(constraint={"regex": "(unclosed"}), "constraint", None),
        ("Hi", SamplingParams(constraint={"json_schema": {"type": "objekt"}}), "constraint", None),
    ],
)
def test_submit_refuses_with_the_field(engine: Engine, prompt, params, field, code) -> None:
    before = engine.num_queued
    with pytest.raises(RequestValidationError) as exc:
        engine.submit(prompt, params)
    assert exc.value.field == field and exc.value.code == code
    assert isinstance(exc.value, ValueError)
    assert engine.num_queued == before


def test_deep_schema_is_refused_not_a_recursion_error() -> None:
    schema: dict = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ValueError, match="constraint: json_schema nests"):
        SamplingParams(constraint={"json_schema": schema})
    text = '{"a": ' * 100_000 + "1" + "}" * 100_000
    with pytest.raises(ValueError, match="constraint: json_schema nests"):
        SamplingParams(constraint={"json_schema": text})


def test_the_engine_keeps_serving_and_logit_bias_applies(engine: Engine) -> None:
    with pytest.raises(RequestValidationError):
        engine.submit("Hi", SamplingParams(min_new_tokens=1, stop_token_ids=[49152]))
    out = engine.generate("Hi", SamplingParams(temperature=0.0, max_new_tokens=4))
    assert len(out.outputs[0].output_token_ids) == 4
    biased = SamplingParams(temperature=0.0, max_new_tokens=4, logit_bias={1234: 100.0})
    assert engine.generate("Hi", biased).outputs[0].output_token_ids == [1234] * 4
    engine.wait_idle(10)
    engine.check_integrity()
    assert engine.stats().kv_pages_used == 0


def test_stats_do_not_wait_for_the_engine_lock(engine: Engine) -> None:
    done = threading.Event()
    with engine._lock:  # a step in progress
        t = threading.Thread(target=lambda: (engine.stats(), done.set()))
        t.start()
        assert done.wait(5), "stats() blocked on the engine lock"
    t.join()


def test_submit_after_shutdown_is_engine_dead(tiny_llama_dir: Path) -> None:
    eng = Engine(str(tiny_llama_dir), dtype="float32", num_pages=16, max_model_len=64)
    eng.shutdown()
    assert not eng.healthy
    with pytest.raises(EngineDeadError):
        eng.submit("Hi")


def test_startup_objects_are_frozen_until_shutdown(tiny_llama_dir: Path) -> None:
    """After init the startup's objects sit in the GC's permanent generation (a full
    collection does not walk them while the engine serves); ``shutdown`` gives them back."""
    import gc

    eng = Engine(str(tiny_llama_dir), dtype="float32", num_pages=16, max_model_len=64)
    try:
        assert gc.get_freeze_count() > 1000
        assert eng.generate("Hi", SamplingParams(max_new_tokens=2)).usage.completion_tokens == 2
    finally:
        eng.shutdown()
    assert gc.get_freeze_count() == 0
