"""Engine snapshots (`radixlm.runtime.observe`) on a scheduler with a fake runner."""

from __future__ import annotations

import random
from concurrent.futures import Future

from test_scheduler import make, prompt, req

from radixlm.radix.summary import SummaryOptions, summarize_full
from radixlm.runtime.observe import SnapshotOptions, take_snapshot


def _memory_adds_up(snap) -> None:
    m = snap.memory
    assert m.free_pages + m.held_pages + m.cached_pages == m.total_pages


def test_prefill_chunks_decoding_and_counters() -> None:
    rng = random.Random(1)
    s = make(num_pages=64, page_size=4, chunked_prefill_size=8, max_batched_tokens=64)
    system = prompt(rng, 16)
    a = req("a", system + prompt(rng, 20), 4)  # 36 prompt tokens: chunks of 8 -> 5 chunks
    s.add_request(a)
    snap = take_snapshot(s)
    assert snap.scheduler.num_waiting == 1 and snap.scheduler.requests[0].state == "waiting"
    s.step()
    (view,) = take_snapshot(s).scheduler.requests
    assert (view.state, view.chunk, view.num_chunks) == ("prefill", 2, 5)
    assert (view.prompt_tokens, view.computed_tokens, view.cached_tokens) == (36, 8, 0)
    assert view.computed_prompt_tokens == 8
    while a.num_computed_tokens < a.num_prompt_tokens:
        s.step()
    snap = take_snapshot(s)
    (view,) = snap.scheduler.requests
    assert view.state == "decoding" and view.output_tokens == 1 and view.age_s >= 0
    assert snap.counters.computed_prompt_tokens == 36 and snap.counters.generated_tokens == 1
    assert snap.scheduler.num_running == 1 and snap.memory.held_pages > 0
    _memory_adds_up(snap)
    while s.has_work():
        s.step()

    # The second request shares the 16-token system prompt: its hit shows in the counters,
    # in its row (cached tokens) and in the tree (a shared node of 16 tokens with one hit).
    b = req("b", system + prompt(rng, 12), 2)
    s.add_request(b)
    s.step()
    snap = take_snapshot(s)
    (view,) = snap.scheduler.requests
    assert view.cached_tokens == 16 and view.computed_prompt_tokens == 8  # 12 to go, chunks of 8
    assert (view.state, view.chunk, view.num_chunks) == ("prefill", 2, 2)
    assert snap.counters.cache_hit_tokens == 16
    assert snap.counters.cache_queried_tokens == 35 + 27  # prompts minus their last token
    shared = [n for n in snap.tree.nodes if n.prefix_tokens == 16]
    assert len(shared) == 1 and shared[0].hits == 1 and shared[0].state == "locked"
    assert snap.tree == summarize_full(s.cache)
    while s.has_work():
        s.step()
    snap = take_snapshot(s)
    assert snap.memory.held_pages == 0 and snap.scheduler.requests == ()
    assert all(n.state in ("root", "evictable") for n in snap.tree.nodes)
    _memory_adds_up(snap)


def test_retracted_evicted_and_grammar_states() -> None:
    rng = random.Random(7)
    s = make(num_pages=16, page_size=4, chunked_prefill_size=64, max_batched_tokens=128)
    reqs = [req(f"r{i}", prompt(rng, 16), 20) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    states: set[str] = set()
    evicted = retracted = 0
    while s.has_work():
        s.step()
        snap = take_snapshot(s)
        _memory_adds_up(snap)
        states.update(v.state for v in snap.scheduler.requests)
        assert snap.memory.evicted_pages >= evicted and snap.memory.retractions >= retracted
        evicted, retracted = snap.memory.evicted_pages, snap.memory.retractions
    assert retracted == s.num_retractions > 0
    assert "retracted" in states and "decoding" in states

    pending = req("g", prompt(rng, 8), 4)
    pending.grammar_future = Future()  # never completes: the request waits for its grammar
    s.add_request(pending)
    s.step()
    assert take_snapshot(s).scheduler.requests[0].state == "grammar"


def test_bounded_rows_and_tree() -> None:
    rng = random.Random(3)
    s = make(num_pages=256, page_size=4, max_running_requests=4)
    for i in range(10):
        s.add_request(req(f"r{i}", prompt(rng, 12), 8))
    s.step()
    opts = SnapshotOptions(tree=SummaryOptions(max_children=2, max_nodes=3), max_requests=5)
    snap = take_snapshot(s, opts)
    assert snap.scheduler.num_running == 4 and snap.scheduler.num_waiting == 6
    assert len(snap.scheduler.requests) == 5
    # One step computed the four whole prompts (no chunking needed) and sampled a token each.
    assert [v.state for v in snap.scheduler.requests[:4]] == ["decoding"] * 4
    assert snap.scheduler.requests[4].state == "waiting"
    assert len(snap.tree.nodes) <= 3 and snap.tree.truncated
