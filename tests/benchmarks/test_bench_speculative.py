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
    assert bs.parse_args(["--workloads", "agent-json"]).workloads == ["agent-json"]
    for bad in (["--modes", "ngram"], ["--modes", "plain,eagle"], ["--workloads", "chat"]):
        with pytest.raises(SystemExit):
            bs.parse_args(bad)


def test_the_runners_work_on_a_tiny_model(tiny_llama_dir: Path) -> None:
    with Engine(
        str(tiny_llama_dir), dtype="float32", page_size=4, num_pages=256,
        speculative_algorithm="ngram",
    ) as engine:  # fmt: skip
        runs = bs.Runs()
        bs.measure(engine, bs.agent_runner(engine, 2, 2, 6), reps=1, repeat=False, runs=runs)
        assert len(runs.outs) == 2 and runs.summary()["tok_s"] > 0
        go = bs.agent_runner(engine, 2, 2, 24, bs.TOOL_CALL_SCHEMA)  # `agent-json`
        runs = bs.Runs()
        bs.measure(engine, go, reps=1, repeat=False, runs=runs)
        assert len(runs.outs) == 2 and runs.summary()["tok_s"] > 0
        go = bs.prompt_runner(engine, "extract", bs.EXTRACT, 2, 6)
        runs = bs.Runs()
        bs.measure(engine, go, reps=1, repeat=True, runs=runs)  # two rounds of one run each
        bs.measure(engine, go, reps=1, repeat=True, runs=runs)
        assert len(runs.speeds) == 2
        assert len(runs.outs) == 2 and all(len(o) == 6 for o in runs.outs)
        extract = runs.summary()
        # The counters cover the timed runs only: 2 x 2 requests of 6 tokens each, i.e. 12
        # tokens per run. The two figures are rounded (forwards to 0.1, tokens per forward to
        # 0.01), so their product is 12 within those roundings (the forwards vary with the
        # measured step cost that sizes the drafts).
        f, t = extract["forwards_per_run"], extract["tokens_per_forward"]
        assert abs(f * t - 12) <= 0.05 * t + 0.005 * f + 1e-3, (f, t)
        assert 0 <= extract["draft_step_share"] <= 1 and extract["drafted_per_run"] >= 0


def test_spec_stats_from_counters() -> None:
    c = bs.Counter(num_forwards=10, forward_tokens=45, generated_tokens=30, spec_decodes=8,
                   spec_drafts=4, spec_draft_tokens=12, spec_accepted_tokens=6)  # fmt: skip
    s = bs.spec_stats(c, reps=2)
    assert s == {
        "forwards_per_run": 5.0, "tokens_per_forward": 3.0, "rows_per_forward": 4.5,
        "acceptance": 0.5,
        "mean_accepted": 1.5, "drafted_per_run": 6.0, "accepted_per_run": 3.0,
        "draft_step_share": 0.5, "tokens_per_verify": 2.5,
    }  # fmt: skip
    assert "acceptance" not in bs.spec_stats(bs.Counter(num_forwards=1, generated_tokens=1), 1)


def test_step_costs_cover_every_batch_and_draft(tiny_llama_dir: Path) -> None:
    with Engine(str(tiny_llama_dir), dtype="float32", page_size=4, num_pages=256) as engine:
        costs = bs.step_costs(engine, [1, 2], context=8, reps=1)
        assert [(c["batch"], c["draft"], c["rows"]) for c in costs] == [
            (b, k, b * (k + 1)) for b in (1, 2) for k in (0, 1, 2, 4)
        ]
        assert all(c["ms"] > 0 for c in costs)
        assert [c["vs_decode"] for c in costs if c["draft"] == 0] == [1.0, 1.0]
        assert engine.stats().kv_pages_cached == 0
