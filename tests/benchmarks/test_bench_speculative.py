"""benchmarks/bench_speculative.py: its workloads are what they claim (grounded in their
inputs, the agent's tool echoes its call) and its runners work end to end on a tiny model (no
timing is checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_loader import load_benchmark

from radixlm import Engine

bs = load_benchmark("bench_speculative")


def test_the_copy_workloads_hold_what_their_answers_copy() -> None:
    for prompt, doc in zip(bs.EXTRACT, bs.DOCS):
        assert doc in prompt and "@" in doc and any(c.isdigit() for c in doc)
    assert all(bs.FUNCTION in p for p in bs.EDIT)
    assert set(bs.SCHEMA["required"]) == set(bs.SCHEMA["properties"])


def test_the_agent_tool_echoes_its_call() -> None:
    call = json.dumps({"tool": "grep", "args": {"pattern": "def f", "path": "src/x.py"}})
    out = json.loads(bs.tool_result(2, call))
    assert out["path"] == "src/x.py" and out["turn"] == 2 and "src/x.py:30" in out["matches"][0]
    assert json.loads(bs.tool_result(0, "not json"))["path"] == "src/app.py"


def test_arguments_are_checked() -> None:
    args = bs.parse_args(["--modes", "plain,draft", "--batches", "1,4", "--vllm"])
    assert args.modes == ["plain", "draft"] and args.batch_sizes == [1, 4]
    assert args.vllm_modes == ["vllm", "vllm-ngram"]
    for bad in (["--modes", "ngram"], ["--modes", "plain,eagle"], ["--workloads", "chat"]):
        with pytest.raises(SystemExit):
            bs.parse_args(bad)


def test_the_runners_work_on_a_tiny_model(tiny_llama_dir: Path) -> None:
    with Engine(
        str(tiny_llama_dir), dtype="float32", page_size=4, num_pages=256,
        speculative_algorithm="ngram",
    ) as engine:  # fmt: skip
        agent = bs.measure(engine, bs.agent_runner(engine, 2, 2, 6), reps=1, repeat=False)
        assert len(agent["outs"]) == 2 and agent["tok_s"] > 0
        go = bs.prompt_runner(engine, "extract", bs.EXTRACT, 2, 6)
        extract = bs.measure(engine, go, reps=1, repeat=True)
        assert len(extract["outs"]) == 2 and all(len(o) == 6 for o in extract["outs"])
