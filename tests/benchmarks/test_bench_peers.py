"""Pure parts of benchmarks/peers/bench_peers.py: prompts, stats, ratios, table, plot.

The benchmark itself (servers, vLLM) never runs in tests.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    path = ROOT / "benchmarks" / "peers" / "bench_peers.py"
    spec = importlib.util.spec_from_file_location("bench_peers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module
    spec.loader.exec_module(module)
    return module


bp = _load()
from serving import RequestResult  # noqa: E402  (benchmarks/ is on sys.path after the load)

WORDS = [f"w{i:03d}x" for i in range(200)]


def count_chars(text: str) -> int:
    """A stand-in tokenizer: one token per 3 characters, rounded up (monotone in the text)."""
    return math.ceil(len(text) / 3)


def test_word_list_keeps_single_token_lowercase_words_sorted() -> None:
    vocab = {f"Ġ{w}": i for i, w in enumerate(["zebra", "apple", "mango"])}
    vocab.update({"ĠAb": 1, "Ġab": 2, "Ġcafé": 3, "Ġabc1": 4, "plain": 5, "Ġtoolongwords": 6})
    vocab.update({f"Ġ{'q' * 3}{chr(97 + i % 26)}{i // 26 * 'z'}": 10 + i for i in range(120)})
    words = bp.word_list(vocab)
    assert words == sorted(words)
    assert {"zebra", "apple", "mango"} <= set(words)
    assert not {"Ab", "ab", "café", "abc1", "plain", "toolongwords"} & set(words)
    with pytest.raises(ValueError, match="plain words"):
        bp.word_list({"Ġapple": 1})


@pytest.mark.parametrize("n", [1, 7, 128, 512])
def test_text_of_tokens_is_the_longest_prefix_within_budget(n: int) -> None:
    text = bp.text_of_tokens(n, WORDS, random.Random(n), count_chars)
    assert count_chars(text) <= n
    rng = random.Random(n)
    full = [rng.choice(WORDS) for _ in range(n)]
    k = len(text.split())
    assert text.split() == full[:k]
    if k < n:  # one more word would exceed the budget
        assert count_chars(" ".join(full[: k + 1])) > n


def test_text_of_tokens_with_one_token_per_word_is_exact() -> None:
    text = bp.text_of_tokens(300, WORDS, random.Random(0), lambda t: len(t.split()))
    assert len(text.split()) == 300


@pytest.mark.parametrize("quick", [True, False])
def test_build_workloads_shapes_and_determinism(quick: bool) -> None:
    def count(text: str) -> int:
        return len(text.split())

    ws = bp.build_workloads(WORDS, count, seed=3, quick=quick)
    assert ws == bp.build_workloads(WORDS, count, seed=3, quick=quick)
    assert ws != bp.build_workloads(WORDS, count, seed=4, quick=quick)
    by = {w.name: w for w in ws}
    assert [w.name for w in ws] == ["c1", "c8", "c32", "shared", "prefill"]
    assert [by[n].concurrency for n in ("c1", "c8", "c32", "shared", "prefill")] == [1, 8, 32, 8, 8]
    sizes = [len(w.prompts) for w in ws]
    assert sizes == ([2, 8, 32, 8, 8] if quick else [8, 32, 64, 32, 16])
    for name in ("c1", "c8", "c32"):
        assert all(128 <= n <= 512 for n in by[name].prompt_tokens)
        assert by[name].max_tokens == 64 and not by[name].warmup
    shared = by["shared"]
    prefix = shared.warmup[0].split()[:1000]
    assert len(shared.warmup) == 1
    for p in shared.prompts:
        assert p.split()[:1000] == prefix and len(p.split()) == 1050
    assert len({p for p in shared.prompts} | {shared.warmup[0]}) == len(shared.prompts) + 1
    assert by["prefill"].max_tokens == 1 and set(by["prefill"].prompt_tokens) == {512}
    for w in ws:
        assert w.prompt_tokens == tuple(count(p) for p in w.prompts)


def _workload(n: int) -> bp.Workload:
    return bp.Workload("c8", 8, tuple(f"p{i}" for i in range(n)), 64, tuple([100] * n))


def test_summarize_counts_tokens_errors_and_percentiles() -> None:
    rs = [
        RequestResult(ok=True, ttft=0.1, tpot=0.02, output_tokens=64, prompt_tokens=120),
        RequestResult(ok=True, ttft=0.3, tpot=0.04, output_tokens=64, prompt_tokens=0),
        RequestResult(ok=False, error="boom"),
    ]
    s = bp.summarize("radixlm", _workload(3), rs, duration_s=2.0)
    assert (s.requests, s.errors, s.first_error) == (3, 1, "boom")
    assert s.output_tokens == 128 and s.output_tok_s == 64.0
    assert s.prompt_tokens == 220  # the server's count, else the client's (100)
    assert s.prompt_tok_s == 110.0
    assert (s.ttft_p50_ms, s.ttft_p99_ms) == pytest.approx((100.0, 300.0))
    assert (s.tpot_p50_ms, s.tpot_p99_ms) == pytest.approx((20.0, 40.0))
    empty = bp.summarize("vllm", _workload(1), [RequestResult(ok=False, error="x")], 1.0)
    assert empty.output_tok_s == 0.0 and math.isnan(empty.ttft_p50_ms)


def _result(
    system: str, workload: str, tok_s: float, ttft: float, tpot: float
) -> bp.WorkloadResult:
    return bp.WorkloadResult(
        system, workload, 8, 8, 0, 1.0, tok_s, 2 * tok_s, ttft, 2 * ttft, tpot, 2 * tpot,
        0, 0, 0,
    )  # fmt: skip


def test_ratios_pair_workloads_and_handle_missing_and_zero() -> None:
    results = [
        _result("radixlm", "c1", 30.0, 100.0, 20.0),
        _result("radixlm", "c8", 150.0, 200.0, 0.0),
        _result("radixlm", "only_mine", 1.0, 1.0, 1.0),
        _result("vllm", "c1", 25.0, 200.0, 40.0),
        _result("vllm", "c8", 100.0, 400.0, 0.0),
    ]
    rats = bp.ratios(results, baseline="vllm")
    assert [q.workload for q in rats] == ["c1", "c8"]
    c1, c8 = rats
    assert c1.output_tok_s == pytest.approx(1.2) and c1.prompt_tok_s == pytest.approx(1.2)
    assert (c1.ttft_p50, c1.ttft_p99, c1.tpot_p50) == pytest.approx((0.5, 0.5, 0.5))
    assert c8.output_tok_s == pytest.approx(1.5) and math.isnan(c8.tpot_p50)
    assert bp.ratios(results, system="vllm", baseline="llamacpp") == []
    assert math.isnan(bp.ratio(math.nan, 1.0)) and bp.ratio(3.0, 2.0) == 1.5


def test_markdown_table_has_rows_and_ratios() -> None:
    results = [
        _result("radixlm", "c1", 30.0, 100.0, 20.0),
        _result("vllm", "c1", 25.0, 200.0, 40.0),
    ]
    results[1].ttft_p99_ms = math.nan
    text = bp.markdown_table(results, bp.ratios(results, baseline="vllm"))
    lines = text.splitlines()
    assert lines[0].startswith("| workload | system |")
    assert "| c1 | radixlm | 8/8 | 30.0 | 60 | 100 / 200 | 20.0 / 40.0 |" in lines
    assert "| c1 | vllm | 8/8 | 25.0 | 50 | 200 / – | 40.0 / 80.0 |" in lines
    assert "| c1 | radixlm/vllm | 1.20x | 1.20x | 0.50x / –x | 0.50x / 0.50x |" in lines
    assert "x |" not in bp.markdown_table(results[:1], [])  # no ratio table for one system


def test_best_of_picks_the_faster_vllm_dtype_per_workload() -> None:
    results = [
        _result("radixlm", "c1", 30.0, 100.0, 20.0),
        _result("radixlm", "prefill", 1.0, 100.0, 20.0),
        _result("vllm-bf16", "c1", 25.0, 200.0, 40.0),
        _result("vllm-fp32", "c1", 20.0, 150.0, 50.0),
        _result("vllm-bf16", "prefill", 1.0, 200.0, 40.0),
        _result("vllm-fp32", "prefill", 3.0, 150.0, 50.0),  # prefill: prompt tok/s decides
    ]
    best = {r.workload: r for r in bp.best_of(results, "vllm-", "vllm-best")}
    assert best["c1"].system == "vllm-best (vllm-bf16)" and best["c1"].output_tok_s == 25.0
    assert best["prefill"].system == "vllm-best (vllm-fp32)"
    rats = bp.ratios([*results, *best.values()])
    assert [(q.workload, q.baseline) for q in rats] == [
        ("c1", "vllm-best"),
        ("prefill", "vllm-best"),
    ]
    assert rats[0].output_tok_s == pytest.approx(1.2)
    assert rats[1].prompt_tok_s == pytest.approx(2 / 6)


def test_parse_args_systems() -> None:
    args = bp.parse_args(["--systems", "vllm", "--llama-server", "/x/llama-server"])
    assert args.systems == ["vllm-bf16", "vllm-fp32", "llamacpp"]
    assert bp.parse_args(["--systems", "vllm-fp32"]).systems == ["vllm-fp32"]
    assert bp.parse_args(["--systems", "radixlm"]).systems == ["radixlm"]
    with pytest.raises(SystemExit):
        bp.parse_args(["--systems", "sglang"])
    with pytest.raises(SystemExit):
        bp.parse_args(["--systems", "llamacpp"])


def test_parse_args_model_defaults() -> None:
    args = bp.parse_args(["--model", "gemma-3-270m"])
    assert args.systems == ["radixlm", "vllm-bf16", "transformers"]
    assert args.workloads == "c1,c8"
    assert args.model_label == "Gemma 3 270M"
    default = bp.parse_args([])
    assert default.systems == ["radixlm", "vllm-bf16", "vllm-fp32"]
    assert default.workloads == "c1,c8,c32,shared,prefill"
    assert bp.parse_args(["--model", "gemma-3-270m", "--workloads", "c1"]).workloads == "c1"


def test_word_list_reads_sentencepiece_words() -> None:
    """Gemma's vocabulary marks a leading space with `▁`, not `Ġ`; a word in both counts once."""
    vocab = {f"▁{'q' * 3}{chr(97 + i % 26)}{i // 26 * 'z'}": i for i in range(120)}
    vocab.update({"▁apple": 200, "Ġapple": 201, "▁Apple": 202, "apple": 203})
    words = bp.word_list(vocab)
    assert words.count("apple") == 1 and "Apple" not in words and len(words) == 121


def test_transformers_result_batches_by_concurrency() -> None:
    calls: list[tuple[int, int]] = []

    def generate(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        calls.append((len(rows), new_tokens))
        return [[7] * new_tokens for _ in rows]

    prompts = tuple(f"p{i}" for i in range(10))
    w = bp.Workload("c8", 8, prompts, 5, tuple([3] * 10))
    r = bp.transformers_result(w, [[1, 2, 3]] * 10, generate)
    assert calls == [(8, 5), (2, 5)]
    assert (r.system, r.requests, r.errors, r.output_tokens, r.prompt_tokens) == (
        "transformers",
        10,
        0,
        50,
        30,
    )
    assert r.output_tok_s == pytest.approx(50 / r.duration_s)
    assert math.isnan(r.ttft_p50_ms) and math.isnan(r.tpot_p50_ms)


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = [
        _result("radixlm", "c1", 30.0, 100.0, 20.0),
        _result("vllm", "c8", 25.0, 200.0, 40.0),
    ]
    path = tmp_path / "peers.png"
    bp.plot(results, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stop_group_kills_the_leader_and_its_children() -> None:
    import os
    import subprocess

    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    try:
        bp._stop_group(proc)
        assert proc.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # no process of the group is left
    finally:
        if proc.poll() is None:
            proc.kill()
