"""Decode CUDA graphs (`radixlm.runtime.cuda_graph`) over the Triton backend.

On CPU the graphs' plumbing runs with `eager_capture` (each replay re-runs the forward on the
static inputs, the Triton kernels in the interpreter): the logits of a replay equal the eager
forward's, padding rows write only the scratch page, and stale rows of an earlier, larger batch
change nothing; the engine's greedy tokens with graphs equal those without, in float32. On
CUDA the same with real graphs.
"""

from __future__ import annotations

import pytest
import torch

from radixlm import Engine, SamplingParams
from radixlm.config import CacheConfig
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.cuda_graph import eager_capture
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.spec.gain import StepCost

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter (conftest)
PAGE = 4
NUM_PAGES = 72


def make_runner(model_dir, graphs: bool, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(
        model_dir,
        dtype,
        torch.device(DEVICE),
        CacheConfig(page_size=PAGE, num_pages=NUM_PAGES),
        attention_backend="triton",
        max_model_len=64,
        cuda_graph_max_bs=8 if graphs else 0,
        graph_capture=None if DEVICE == "cuda" else eager_capture,
    )


def prompts(n: int) -> list[list[int]]:
    return [[(i * 7919 + j * 104729) % 40000 + 5 for j in range(3 + 4 * i)] for i in range(n)]


def prefill(runner: ModelRunner, ids: list[list[int]]) -> list[list[int]]:
    """Prefill every prompt eagerly (pages 0.. handed out in order); returns the page lists."""
    pages, nxt = [], 0
    for p in ids:
        need = -(-(len(p) + 8) // PAGE)  # room for 8 decode steps
        pages.append(list(range(nxt, nxt + need)))
        nxt += need
    assert nxt <= NUM_PAGES
    batch = ForwardBatch.build(ids, [0] * len(ids), pages, [[len(p) - 1] for p in ids], PAGE,
                               DEVICE)  # fmt: skip
    runner.forward(batch)
    return pages


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [b.clone() for b in (*runner.kv_cache.k_buffers, *runner.kv_cache.v_buffers)]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_graph_replay_matches_eager(request, model):
    model_dir = request.getfixturevalue(model)
    runner = make_runner(model_dir, graphs=True)
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8]
    assert runner.scratch_page == NUM_PAGES
    assert runner.kv_cache.k_buffers[0].shape[0] == (NUM_PAGES + 1) * PAGE  # the scratch page
    eager = make_runner(model_dir, graphs=False)
    assert eager.decode_graphs is None
    assert eager.kv_cache.k_buffers[0].shape[0] == NUM_PAGES * PAGE
    ids = prompts(8)
    pages = prefill(runner, ids)
    assert prefill(eager, ids) == pages
    # 8 rows (a full bucket), then 5 (bucket 8: 3 padding rows over the stale rows of the 8),
    # then 3 (bucket 4), 1, and 6 rows out of order.
    plan = [list(range(8)), [0, 2, 4, 6, 7], [1, 3, 5], [2], [7, 6, 5, 1, 0, 3]]
    steps = dict.fromkeys(range(8), 0)
    for rows in plan:
        batch = ForwardBatch.build(
            [[1000 + 17 * r + steps[r]] for r in rows],
            [len(ids[r]) + steps[r] for r in rows],
            [pages[r] for r in rows],
            [[0]] * len(rows),
            PAGE,
            DEVICE,
        )
        before = snapshot(runner)
        replays = graphs.replays
        got = runner.forward(batch)
        assert graphs.replays == replays + 1
        want = eager.forward(batch)
        assert got.shape == want.shape == (len(rows), runner.vocab_size)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        # Only the batch's own new slots and the scratch page changed.
        slots = {int(s) for s in batch.out_cache_loc.tolist()}
        scratch = set(range(NUM_PAGES * PAGE, (NUM_PAGES + 1) * PAGE))
        for old, new in zip(before, snapshot(runner)):
            changed = (old != new).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= slots | scratch
        for r in rows:
            steps[r] += 1
    # The graphs' K/V equal the eager runner's for every real page.
    real = NUM_PAGES * PAGE
    for a, b in zip(snapshot(runner), snapshot(eager)):
        torch.testing.assert_close(a[:real], b[:real], atol=2e-5, rtol=2e-5)


def test_graphs_serve_short_extends_as_decode_rows(tiny_llama_dir):
    """A forward of up to `max_bs` tokens replays: each new token is a decode row over its
    request's pages (a speculative verification: k + 1 tokens per request). Logits and K/V
    equal the eager extend's; more tokens than the largest bucket run eagerly."""
    runner = make_runner(tiny_llama_dir, graphs=True)
    eager = make_runner(tiny_llama_dir, graphs=False)
    graphs = runner.decode_graphs
    ids = prompts(2)  # 3 + 7 tokens: more than the largest bucket (8), eager
    pages = prefill(runner, ids)
    assert prefill(eager, ids) == pages
    assert graphs.replays == 0
    lens = [len(p) for p in ids]
    steps = [
        ([[5], [6, 7]], [[0], [0, 1]]),  # a decode row beside a 2-token extend
        ([[8, 9, 10, 11], [12, 13, 14]], [[0, 1, 2, 3], [0, 1, 2]]),  # 4 + 3: a verification
        ([[15, 16, 17], [18]], [[1, 2], []]),  # rows without logits
    ]
    for chunks, rows in steps:
        batch = ForwardBatch.build(chunks, lens, pages, rows, PAGE, DEVICE)
        replays = graphs.replays
        got = runner.forward(batch)
        assert graphs.replays == replays + 1
        want = eager.forward(batch)
        assert got.shape == want.shape == (sum(map(len, rows)), runner.vocab_size)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        lens = [n + len(c) for n, c in zip(lens, chunks)]
    real = NUM_PAGES * PAGE
    for a, b in zip(snapshot(runner), snapshot(eager)):
        torch.testing.assert_close(a[:real], b[:real], atol=2e-5, rtol=2e-5)
    nine = ForwardBatch.build([[1] * 5, [2] * 4], [0, 0], pages, [[4], [3]], PAGE, DEVICE)
    assert graphs.bucket_for(nine) is None
    one = ForwardBatch.build([[5]], [lens[0]], pages[:1], [[0]], PAGE, DEVICE)
    assert graphs.bucket_for(one) == 1
    # No logits wanted for a row: the replay still runs, and returns no rows.
    none = ForwardBatch.build([[5]], [lens[0]], pages[:1], [[]], PAGE, DEVICE)
    assert runner.forward(none).shape == (0, runner.vocab_size)


def test_graphs_off_where_the_forward_plans_on_the_host(tiny_llama_dir):
    runner = ModelRunner(
        tiny_llama_dir, "float32", torch.device("cpu"), CacheConfig(page_size=PAGE, num_pages=8),
        attention_backend="torch", cuda_graph_max_bs=8, graph_capture=eager_capture,
    )  # fmt: skip
    assert runner.decode_graphs is None
    assert runner.kv_cache.k_buffers[0].shape[0] == 8 * PAGE  # no scratch page
    eager = ModelRunner(
        tiny_llama_dir, "float32", torch.device(DEVICE), CacheConfig(page_size=PAGE, num_pages=8),
        attention_backend="triton", cuda_graph_max_bs=8, enforce_eager=True,
        graph_capture=None if DEVICE == "cuda" else eager_capture,
    )  # fmt: skip
    assert eager.decode_graphs is None


def test_engine_greedy_tokens_with_and_without_graphs(tiny_qwen2_dir, monkeypatch):
    """float32: the engine's greedy tokens are the same with decode graphs as without, for
    batches that fill buckets partly (3, 5, 11 requests: padding rows), and with n-gram
    speculative decoding on (its verify steps run eagerly, plain decode steps replay), and with
    a draft model (the model drafting for itself: its own runner's graphs). On CPU
    the runner's capture is `eager_capture` (the engine's path through the graphs, replays
    re-run)."""
    if DEVICE == "cpu":
        init = ModelRunner.__init__

        def with_eager_capture(self, *args, **kwargs):
            init(self, *args, **dict(kwargs, graph_capture=eager_capture))

        monkeypatch.setattr(ModelRunner, "__init__", with_eager_capture)
    # A flat step cost: every found draft is verified (the plumbing under test, not the planner,
    # which on CPU finds the interpreter's verification rows too dear to draft).
    monkeypatch.setattr(StepCost, "cost", lambda self, rows: 1.0)
    new = 12 if DEVICE == "cuda" else 4
    params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
    periodic = [[5, 6, 7, 8] * (2 + i) for i in range(4)]
    batches = [prompts(3), prompts(5), prompts(11), periodic]
    if DEVICE == "cpu":
        batches = [prompts(3), periodic[:2]]
    out = {}
    for name, kw in {
        "eager": dict(disable_cuda_graph=True),
        "graphs": {},
        "graphs-spec-ngram": dict(speculative_algorithm="ngram"),
        # the draft model's own runner replays its own graphs (scratch page past its pool)
        "graphs-spec-draft": dict(
            speculative_algorithm="draft", speculative_draft_model=str(tiny_qwen2_dir)
        ),
    }.items():
        with Engine(
            str(tiny_qwen2_dir), dtype="float32", device=DEVICE, attention_backend="triton",
            num_pages=256, page_size=16, cuda_graph_max_bs=16 if DEVICE == "cuda" else 4,
            debug_integrity=True,
            num_threads=1, **kw,
        ) as engine:  # fmt: skip
            graphs = engine.runner.decode_graphs
            assert (graphs is None) == (name == "eager")
            toks = []
            for batch in batches:
                toks += [r.output_token_ids for r in engine.generate(batch, params)]
            # Prompt lookup drafts the engine's own first outputs: each prompt, its output, the
            # prompt again.
            echo = [p + o + p for p, o in zip(batches[0], toks)]
            toks += [r.output_token_ids for r in engine.generate(echo, params)]
            assert engine.wait_idle(timeout=60)
            engine.check_integrity()
            if graphs is not None and name != "graphs-spec-draft":
                assert graphs.replays > 0
            if name == "graphs-spec-ngram":  # its verifications replay as decode rows
                assert engine.stats().spec_drafts > 0 and graphs.extend_replays > 0
            if name == "graphs-spec-draft":  # NOTE: the target verifies drafts every step
                draft = engine.parts.executor.proposer.runner.decode_graphs
                assert draft is not None and draft.replays > 0
                assert engine.stats().spec_accepted_tokens > 0  # it drafts for itself
            out[name] = toks
    for name in out:
        assert out[name] == out["eager"], name
