"""Gemma 3 text against transformers, float32: GeGLU, scaled embeddings, (1 + w) norms, q/k norm,
four norms per layer, local/global RoPE bases, and interleaved sliding-window layers on prompts
longer than the window (the full context is served, not clamped to the window)."""

from __future__ import annotations

import pytest
import torch
from family_check import (
    PROMPTS,
    assert_engine_matches_generate,
    assert_logits_match,
)

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tiny_gemma3_dir(make_tiny_model):
    return make_tiny_model(
        "gemma3_text",
        seed=10,
        num_hidden_layers=3,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def tiny_gemma3_softcap_dir(make_tiny_model):
    return make_tiny_model(
        "gemma3_text",
        seed=11,
        num_hidden_layers=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    )


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("chunks", [[30], [7, 13, 10], [3, 1, 1, 1, 24]])
def test_logits_match_transformers(tiny_gemma3_dir, backend, chunks):
    ids = [(i * 7919) % 40000 + 5 for i in range(30)]
    runner = assert_logits_match(tiny_gemma3_dir, ids, chunks, backend)
    assert runner.model.sliding_windows() == [WINDOW, 0, WINDOW]


def test_softcapping_matches_transformers(tiny_gemma3_softcap_dir):
    """Final logits capped; the attention cap is ignored, as transformers' Gemma 3 does."""
    ids = [(i * 31) % 30000 + 7 for i in range(20)]
    assert_logits_match(tiny_gemma3_softcap_dir, ids, [6, 14])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_greedy_matches_generate(tiny_gemma3_dir, backend):
    """Every prompt is longer than the window; chunked prefill and decode cross it."""
    assert all(len(p) > WINDOW for p in PROMPTS[:3])
    assert_engine_matches_generate(tiny_gemma3_dir, attention_backend=backend)


def test_full_context_is_served(tiny_gemma3_dir):
    from radixlm.runtime.models.model_info import context_length, load_model_info

    info = load_model_info(tiny_gemma3_dir)
    assert info.sliding_window == WINDOW
    assert context_length(info, None) == info.max_position_embeddings


def test_retraction_matches_generate(tiny_gemma3_dir):
    """Six concurrent prompts in a pool too small for all of them: requests are retracted and
    recomputed, crossing the window again; outputs still equal `generate`."""
    from family_check import hf_greedy

    from radixlm import Engine, SamplingParams

    prompts = [[(i * 131 + j * 17) % 30000 + 9 for j in range(20)] for i in range(6)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=30, num_threads=1,
        chunked_prefill_size=8, max_batched_tokens=24,
    ) as engine:  # fmt: skip
        ours = [r.outputs[0].output_token_ids for r in engine.generate(prompts, params)]
        assert engine.stats().num_retractions > 0
        engine.check_integrity()
    assert ours == hf_greedy(tiny_gemma3_dir, prompts, 12)


def test_speculative_decoding_matches_generate(tiny_gemma3_dir):
    """Drafts (the radix tree's continuation of a repeated prompt) verified as extends over the
    sliding layers: accepted, and the tokens are `generate`'s."""
    from family_check import hf_greedy

    from radixlm import Engine, SamplingParams

    prompt = PROMPTS[2]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=64, num_threads=1,
        speculative_algorithm="ngram",
    ) as engine:  # fmt: skip
        first = engine.generate(prompt, params).outputs[0].output_token_ids
        again = engine.generate(prompt, params).outputs[0].output_token_ids
        assert engine.stats().spec_accepted_tokens > 0
        engine.check_integrity()
    assert first == again == hf_greedy(tiny_gemma3_dir, [prompt], 12)[0]


# ---- the hybrid pool: sliding-window layers' pages released outside the window ----------------


def test_hybrid_pool_is_used_and_a_dense_model_keeps_one_pool(tiny_gemma3_dir, make_tiny_model):
    from radixlm import Engine
    from radixlm.radix import BlockPool, HybridBlockPool

    kw = dict(dtype="float32", page_size=4, num_pages=40, num_threads=1)
    with Engine(str(tiny_gemma3_dir), swa_full_tokens_ratio=0.25, **kw) as engine:
        assert isinstance(engine.pool, HybridBlockPool)
        assert engine.pool.window == WINDOW and engine.pool.windows.num_pages == 10
        # layers 0 and 2 (sliding) live in the window buffers only; layer 1 in the full ones
        kv = engine.runner.kv_cache
        assert [b.shape[0] for b in kv.full.k_buffers] == [0, 40 * 4, 0]
        assert [b.shape[0] for b in kv.windowed.k_buffers] == [11 * 4, 0, 11 * 4]
    with Engine(str(tiny_gemma3_dir), disable_hybrid_swa_memory=True, **kw) as engine:
        assert type(engine.pool) is BlockPool
    llama = make_tiny_model("llama", seed=3)
    with Engine(str(llama), **kw) as engine:
        assert type(engine.pool) is BlockPool


@pytest.mark.parametrize(
    ("backend", "ratio"), [("torch", 0.25), ("cpu", 0.25), ("torch", 0.1), ("cpu", 0.1)]
)
def test_hybrid_pool_greedy_matches_generate_with_a_small_window_pool(
    tiny_gemma3_dir, backend, ratio
):
    """Prompts longer than the window, chunked prefill, a prefix hit on a shared 21-token prefix,
    a concurrent batch: with a window pool a quarter or a tenth of the full pool (at a tenth,
    cached window pages are evicted, the hit is cut where the window layers lost their keys,
    and requests are retracted), tokens equal `generate`'s."""
    from family_check import PROMPTS, engine_greedy, hf_greedy

    ours, stats = engine_greedy(
        tiny_gemma3_dir, PROMPTS, 12, attention_backend=backend, num_pages=64,
        swa_full_tokens_ratio=ratio, debug_integrity=True,
    )  # fmt: skip
    assert stats.cache_hit_tokens > 0
    assert ours == hf_greedy(tiny_gemma3_dir, PROMPTS, 12)


def test_window_pages_held_stay_bounded_as_a_sequence_grows(tiny_gemma3_dir):
    """One 80-token sequence through a window pool of 6 pages (24 tokens): it completes only
    because pages leaving the window are released; the window pages held never exceed the
    window plus a chunk, while the full pages grow with the sequence. Tokens equal
    `generate`'s."""
    import threading

    from family_check import hf_greedy

    from radixlm import Engine, SamplingParams

    prompt = [(i * 37) % 30000 + 11 for i in range(20)]
    params = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)
    held: list[tuple[int, int]] = []
    tokens: list[int] = []
    done = threading.Event()
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=60, num_threads=1,
        swa_full_tokens_ratio=0.1, chunked_prefill_size=8, debug_integrity=True,
    ) as engine:  # fmt: skip
        pool = engine.pool
        assert pool.windows.num_pages == 6

        def sink(out) -> None:  # on the loop thread, between steps
            held.append((pool.num_held, pool.windows.num_held))
            tokens.extend(out.token_ids)
            if out.finished:
                done.set()

        engine.submit(prompt, params, sink=sink)
        assert done.wait(120)
        engine.check_integrity()
        assert pool.num_held == 0 and pool.windows.num_held == 0
    assert tokens == hf_greedy(tiny_gemma3_dir, [prompt], 60)[0]
    assert max(f for f, _ in held) >= 19  # the full pages grow with the sequence
    # window 8 over 4-token pages: the 2 pages before the current one, it, the next
    assert max(w for _, w in held) <= 4


def _wait_idle(engine, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work() or engine.num_queued:
        assert time.monotonic() < deadline, "engine did not finish"
        time.sleep(0.02)


def test_abort_releases_every_window_page(tiny_gemma3_dir):
    from radixlm import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=128, num_threads=1,
        swa_full_tokens_ratio=0.25, chunked_prefill_size=8, debug_integrity=True,
    ) as engine:  # fmt: skip
        prompts = [[(i * 13 + j) % 30000 + 3 for j in range(30)] for i in range(3)]
        stream = engine.stream(prompts[0], params)
        for k, _ in enumerate(stream):
            if k == 5:
                break
        stream.close()  # closing the stream aborts the request
        ids = [engine.submit(p, params) for p in prompts[1:]]
        for rid in ids:
            engine.abort(rid)
        _wait_idle(engine)
        engine.check_integrity()
        assert engine.pool.num_held == 0 and engine.pool.windows.num_held == 0


def test_prefix_hit_after_the_window_pages_were_evicted_recomputes(tiny_gemma3_dir):
    """A cached prefix whose window pages were all evicted (tombstones for the window layers) is
    not a hit: the request recomputes it, its window pages move onto the tree's pages, and a
    third request hits the whole prefix again. Tokens equal `generate`'s throughout."""
    from family_check import hf_greedy

    from radixlm import Engine, SamplingParams

    prefix = [(i * 53) % 30000 + 17 for i in range(40)]
    prompts = [prefix + [7, 8], prefix + [9], prefix + [10, 11, 12]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=64, num_threads=1,
        chunked_prefill_size=8, debug_integrity=True,
    ) as engine:  # fmt: skip
        outs = [engine.generate(prompts[0], params)]
        with engine._lock:  # the loop is idle: evict every cached window page
            assert engine.pool.evict_swa(engine.pool.windows.num_pages) > 0
        hits = engine.stats().cache_hit_tokens
        outs.append(engine.generate(prompts[1], params))
        assert engine.stats().cache_hit_tokens == hits  # no page of the prefix is usable
        outs.append(engine.generate(prompts[2], params))
        assert engine.stats().cache_hit_tokens - hits == 40
        engine.check_integrity()
    ours = [o.outputs[0].output_token_ids for o in outs]
    assert ours == hf_greedy(tiny_gemma3_dir, prompts, 8)


def test_forked_branches_share_window_pages_and_match_generate(tiny_gemma3_dir):
    """n = 2 greedy branches fork after a 21-token prompt (a partial page, copied for each
    branch in both pools): both equal `generate`, and nothing is held afterwards."""
    from family_check import SHARED, hf_greedy

    from radixlm import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    with Engine(
        str(tiny_gemma3_dir), dtype="float32", page_size=4, num_pages=64, num_threads=1,
        swa_full_tokens_ratio=0.25, chunked_prefill_size=8, debug_integrity=True,
    ) as engine:  # fmt: skip
        out = engine.generate(SHARED, params)
        engine.check_integrity()
        assert engine.pool.num_held == 0 and engine.pool.windows.num_held == 0
    want = hf_greedy(tiny_gemma3_dir, [SHARED], 12)[0]
    assert [c.output_token_ids for c in out.outputs] == [want, want]


def test_memory_budget_is_split_between_the_two_pools(tiny_gemma3_dir):
    """`kv_memory_bytes` buys full pages (1 full layer) and `swa_full_tokens_ratio` x as many
    window pages (2 window layers) within the budget; the dense pool gets fewer pages."""
    from radixlm import Engine
    from radixlm.kernels.forward_batch import KVCache

    budget = 1 << 20
    kw = dict(dtype="float32", page_size=4, num_threads=1, kv_memory_bytes=budget)
    with Engine(str(tiny_gemma3_dir), swa_full_tokens_ratio=0.5, **kw) as engine:
        cfg = engine.runner.model_config
        layer_page = KVCache.bytes_per_page(1, 4, cfg.num_key_value_heads, 16, torch.float32)
        full, window = engine.pool.num_pages, engine.pool.windows.num_pages
        assert window == -(-full // 2)
        assert full * layer_page + window * 2 * layer_page <= budget + 2 * layer_page
        assert full == budget // (2 * layer_page)  # 1 + 0.5 x 2 layers per full page
    with Engine(str(tiny_gemma3_dir), disable_hybrid_swa_memory=True, **kw) as engine:
        assert engine.pool.num_pages == budget // (3 * layer_page) < full
