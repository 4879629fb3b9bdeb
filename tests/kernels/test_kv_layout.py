"""The `pairs16` KV layout (bf16 K stored as (d, d + 1) pairs across each block of 16 keys, V as
(key 2i, key 2i + 1) pairs): conversions and slot reads/writes against the flat layout, the
compiled CPU op on it (decode, split-KV, extend, shared-prefix items, windows, stale NaN slots)
against dense SDPA and against itself on the flat layout, the torch twin on it, the op's
refusals, and the layout a model runner picks."""

from __future__ import annotations

import pytest
import torch

from radixlm.config import CacheConfig
from radixlm.kernels.cpu import build
from radixlm.kernels.forward_batch import (
    ForwardBatch,
    KVCache,
    flat_from_pairs16,
    pairs16_from_flat,
)
from radixlm.kernels.reference import TorchAttentionBackend
from radixlm.kernels.registry import create_attention_backend, preferred_kv_layout

SCALE = 0.125


def _has_bf16_dot() -> bool:
    op = build.load_op()
    return op is not None and bool(op.has_bf16_dot())


needs_bf16_dot = pytest.mark.skipif(
    not _has_bf16_dot(), reason="the pairs16 kernels need AVX512_BF16 (and the built op)"
)


@pytest.mark.parametrize("heads,d", [(1, 4), (3, 64), (2, 128)])
def test_conversion_round_trip_and_slot_access(heads, d):
    """pairs16 storage holds the same values: round trip, `read_rows` of any slots, and a
    `write_rows` lands where `pairs16_from_flat` puts it."""
    gen = torch.Generator().manual_seed(d)
    flat = torch.randn(64, heads, d, generator=gen).bfloat16()
    k16, v16 = pairs16_from_flat(flat, "k"), pairs16_from_flat(flat, "v")
    assert not torch.equal(k16, flat) and not torch.equal(v16, flat)
    assert torch.equal(flat_from_pairs16(k16, "k"), flat)
    assert torch.equal(flat_from_pairs16(v16, "v"), flat)
    cache = KVCache([k16.clone()], [v16.clone()], 16, "pairs16")
    slots = torch.tensor([0, 1, 15, 16, 17, 33, 62, 63])
    assert torch.equal(cache.read_rows(0, "k", slots), flat[slots])
    assert torch.equal(cache.read_rows(0, "v", slots), flat[slots])
    new = torch.randn(len(slots), heads, d, generator=gen)
    cache.write_rows(0, "k", slots, new)
    cache.write_rows(0, "v", slots, new)
    expect = flat.clone()
    expect[slots] = new.bfloat16()
    assert torch.equal(cache.k_buffers[0], pairs16_from_flat(expect, "k"))
    assert torch.equal(cache.v_buffers[0], pairs16_from_flat(expect, "v"))
    assert torch.equal(cache.as_layout("flat").k_buffers[0], expect)


def test_layout_is_validated():
    with pytest.raises(ValueError, match="pairs16"):
        KVCache.allocate(1, 4, 8, 1, 64, torch.bfloat16, "cpu", "pairs16")
    with pytest.raises(ValueError, match="KV layout"):
        KVCache.allocate(1, 4, 16, 1, 64, torch.bfloat16, "cpu", "blocked")


def test_torch_twin_reads_pairs16_exactly(paged_case):
    """The torch twin (store + paged SDPA) gives bit-identical output on either layout."""
    case = paged_case([(0, 9), (40, 1), (17, 6), (100, 1)], 6, 2, 64, 16, torch.bfloat16, seed=3,
                      device="cpu")  # fmt: skip
    outs = []
    for layout in ("flat", "pairs16"):
        cache = case.cache.as_layout(layout)
        twin = TorchAttentionBackend(cache)
        twin.init_forward(case.batch)
        outs.append(twin.forward(0, case.q, case.k_new, case.v_new, SCALE))
        loc = case.batch.out_cache_loc
        assert torch.equal(cache.read_rows(0, "k", loc), case.k_new)
    assert torch.equal(outs[0], outs[1])


def run_cpu(case, layout: str, window: int = 0, **knobs) -> tuple[torch.Tensor, KVCache]:
    cache = case.cache.as_layout(layout)
    backend = create_attention_backend("cpu", cache)
    for name, value in knobs.items():
        setattr(backend, name, value)
    backend.init_forward(case.batch)
    return backend.forward(0, case.q, case.k_new, case.v_new, SCALE, window), cache


def check_layouts(case, window: int = 0, **knobs) -> None:
    """pairs16 output vs dense SDPA (bf16 tolerance) and vs the flat-layout op; the op's store
    wrote the new K/V where `read_rows` finds them."""
    out, cache = run_cpu(case, "pairs16", window, **knobs)
    loc = case.batch.out_cache_loc
    assert torch.equal(cache.read_rows(0, "k", loc), case.k_new)
    assert torch.equal(cache.read_rows(0, "v", loc), case.v_new)
    assert torch.isfinite(out).all()
    tol = case.tol()
    torch.testing.assert_close(out.float(), case.dense_reference(SCALE, window), atol=tol, rtol=tol)
    flat, _ = run_cpu(case, "flat", window, **knobs)
    torch.testing.assert_close(out.float(), flat.float(), atol=tol, rtol=tol)


DECODE = [(0, 1), (3, 1), (15, 1), (16, 1), (31, 1), (63, 1), (64, 1), (200, 1), (777, 1)]
MIXED = [(0, 1), (17, 1), (0, 33), (48, 1), (5, 11), (130, 1), (64, 20), (0, 2), (9, 3)]


@needs_bf16_dot
@pytest.mark.parametrize(
    "heads", [(9, 3, 64), (8, 1, 128), (4, 4, 64), (12, 1, 32), (40, 20, 64)], ids=str
)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("shapes", [DECODE, MIXED], ids=["decode", "mixed"])
def test_op_on_pairs16_matches_dense_and_flat(paged_case, heads, page_size, shapes):
    """Decode rows of every length around block and page edges, extends of 2 rows (the tiles
    under 8 query rows) to 33, GQA 1 / 3 / 8 / 12 (12: past the decode kernel's 8, the tiles);
    20 KV heads: more than the decode kernel's block-major pass takes at once (16), so a
    second pass of 4."""
    hq, hkv, d = heads
    case = paged_case(shapes, hq, hkv, d, page_size, torch.bfloat16, seed=page_size + hq,
                      device="cpu")  # fmt: skip
    check_layouts(case)


@needs_bf16_dot
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_kv_items_start_inside_blocks(paged_case, splits):
    """Split-KV items whose key ranges start and end inside 16-key blocks (masked lanes)."""
    case = paged_case([(1000, 1), (517, 1), (90, 1)], 9, 3, 64, 16, torch.bfloat16, seed=splits,
                      device="cpu")  # fmt: skip
    check_layouts(case, force_num_kv_splits=splits)


@needs_bf16_dot
@pytest.mark.parametrize("window", [5, 16, 40])
def test_sliding_window_on_pairs16(paged_case, window):
    shapes = [(0, 1), (5, 1), (40, 1), (0, 23), (9, 14), (30, 5), (3, 17), (60, 1), (300, 1)]
    case = paged_case(shapes, 6, 2, 64, 16, torch.bfloat16, seed=window, device="cpu")
    check_layouts(case, window)


@needs_bf16_dot
def test_shared_prefix_items_on_pairs16(paged_case):
    """Rows sharing 256 leading keys on the same pages: shared items (9 rows and 2 rows, both
    through `shared_rows_pairs16`: each block read once for all rows) and their own keys,
    split or not."""
    shapes = [(300, 1)] * 9 + [(270, 1)] * 2 + [(500, 1)]
    groups = [0] * 9 + [1] * 2 + [-1]
    case = paged_case(shapes, 9, 3, 64, 16, torch.bfloat16, seed=5, device="cpu", groups=groups,
                      shared_tokens=256)  # fmt: skip
    out, _ = run_cpu(case, "pairs16")
    for split_at in (256, 48):
        check_layouts(case, min_tokens_per_split=split_at)
    cache = case.cache.as_layout("pairs16")
    backend = create_attention_backend("cpu", cache)
    backend.init_forward(case.batch)
    assert backend.plan.num_shared_items >= 2


@needs_bf16_dot
@pytest.mark.parametrize(
    "shapes,shared",
    [([(2047, 5)], True), ([(300, 2)], False), ([(0, 3), (999, 8)], True), ([(15, 2)], False)],
    ids=str,
)
def test_small_extends_as_shared_items_of_their_own_rows(paged_case, shapes, shared):
    """A speculative verification (2-8 rows) alone in its step over keys long enough to cut:
    shared-prefix items of its own rows (cut for the threads) plus each later row's new keys,
    merged; equal to dense SDPA and to the tiles (`small_extend_rows = 0`). Over fewer keys
    (one piece): the tiles."""
    case = paged_case(shapes, 9, 3, 64, 16, torch.bfloat16, seed=len(shapes), device="cpu")
    torch.set_num_threads(2)
    try:
        check_layouts(case, small_extend_rows=8)
        small, _ = run_cpu(case, "pairs16", small_extend_rows=8)
        tiles, _ = run_cpu(case, "pairs16", small_extend_rows=0)
        tol = case.tol()
        torch.testing.assert_close(small.float(), tiles.float(), atol=tol, rtol=tol)
        cache = case.cache.as_layout("pairs16")
        backend = create_attention_backend("cpu", cache)
        backend.init_forward(case.batch)
        assert backend.small_extend_rows == 8  # the default on pairs16
        assert bool((backend.plan.items[:, 2] < 0).any()) == shared
    finally:
        torch.set_num_threads(1)


@needs_bf16_dot
def test_stale_nan_slots_are_never_read(paged_case):
    """Slots past a request's length in its last block (and every unused slot) hold NaN: the
    output stays finite and correct (P is 0 there, and 0 * NaN would not be)."""
    shapes = [(20, 1), (0, 5), (33, 1), (47, 2), (100, 1)]
    case = paged_case(shapes, 9, 3, 64, 16, torch.bfloat16, seed=1, device="cpu")
    used = torch.zeros(case.k_buf.shape[0], dtype=torch.bool)
    for (prefix, _), pages in zip(shapes, case.pages):
        for j in range(prefix):
            used[pages[j // 16] * 16 + j % 16] = True
    case.k_buf[~used] = float("nan")
    case.v_buf[~used] = float("nan")
    out, _ = run_cpu(case, "pairs16")
    assert torch.isfinite(out).all()
    tol = case.tol()
    torch.testing.assert_close(out.float(), case.dense_reference(SCALE), atol=tol, rtol=tol)
    for splits in (2, 3):
        out, _ = run_cpu(case, "pairs16", force_num_kv_splits=splits)
        assert torch.isfinite(out).all()


@needs_bf16_dot
def test_op_refuses_pairs16_where_it_cannot_read_it():
    op = build.load_op()
    flat = KVCache.allocate(1, 4, 16, 1, 64, torch.float32, "cpu")
    batch = ForwardBatch.build([[1]], [0], [[0]], [[0]], 16, "cpu")
    backend = create_attention_backend("cpu", flat)
    backend.init_forward(batch)
    q = torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="pairs16"):
        op.paged_attention(q, flat.k_buffers[0], flat.v_buffers[0], torch.empty_like(q),
                           backend.page_table, backend.plan.items, backend.plan.item_rows,
                           backend.plan.reduces, torch.empty(0, 1, 64), torch.empty(0, 1), 16,
                           SCALE, 0, 1)  # fmt: skip


def test_preferred_layouts():
    """pairs16 only where the CPU op reads it fast (bf16, AVX512_BF16, pages of 16k, D % 32);
    the torch and Triton backends keep flat."""
    want = "pairs16" if _has_bf16_dot() else "flat"
    assert preferred_kv_layout("cpu", torch.bfloat16, 16, 64) == want
    assert preferred_kv_layout("cpu", torch.bfloat16, 32, 128) == want
    assert preferred_kv_layout("cpu", torch.float32, 16, 64) == "flat"
    assert preferred_kv_layout("cpu", torch.bfloat16, 8, 64) == "flat"
    assert preferred_kv_layout("cpu", torch.bfloat16, 16, 48) == "flat"
    assert preferred_kv_layout("torch", torch.bfloat16, 16, 64) == "flat"
    assert preferred_kv_layout("no-such-backend", torch.bfloat16, 16, 64) == "flat"


@needs_bf16_dot
def test_runner_picks_pairs16_and_matches_flat(make_tiny_model, monkeypatch, runner_logits):
    """A bf16 model runner on the CPU op allocates pairs16 (head dim 32 here); its logits over
    prefill, extend over the paged prefix and decodes match the same runner on a flat cache."""
    from radixlm.runtime import model_runner as mr

    model_dir = make_tiny_model("llama", 5, hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2)  # fmt: skip

    logits = {}
    for layout in ("pairs16", "flat"):
        if layout == "flat":
            monkeypatch.setattr(mr, "preferred_kv_layout", lambda *a: "flat")
        runner = mr.ModelRunner(
            model_dir, "bfloat16", torch.device("cpu"),
            CacheConfig(page_size=16, num_pages=8), attention_backend="cpu",
        )  # fmt: skip
        assert runner.kv_cache.layout == layout
        logits[layout] = runner_logits(runner, (7, 20, 1, 1, 1), 4)
    torch.testing.assert_close(logits["pairs16"], logits["flat"], atol=5e-2, rtol=5e-2)
