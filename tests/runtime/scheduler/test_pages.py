"""PageManager alone: prefix adoption, allocation with eviction and reserve, release, caching
computed pages, sharing a parent's prefix; the ref-count check catches a leak."""

from __future__ import annotations

import pytest

from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.request import Request
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.pages import PageManager


def make(num_pages: int = 8, page_size: int = 4) -> PageManager:
    pool = BlockPool(num_pages, page_size)
    return PageManager(pool, RadixCache(pool))


def req(prompt: list[int]) -> Request:
    return Request("r", prompt, SamplingParams(max_new_tokens=4))


def computed(pm: PageManager, r: Request, n: int) -> None:
    """`r` has computed its first `n` tokens into freshly allocated pages, cached in the tree."""
    assert pm.try_grow(r, n)
    r.num_computed_tokens = n
    pm.cache_computed(r)


def test_cached_prefix_is_adopted_and_released():
    pm = make()
    a = req(list(range(10)))
    computed(pm, a, 8)
    pm.release(a)
    assert pm.pool.num_held == 0 and pm.pool.num_cached == 2
    b = req(list(range(9)) + [99])
    gen = b.page_gen
    assert pm.adopt_prefix(b) == 8
    assert b.num_computed_tokens == 8 and len(b.pages) == 2 and b.page_gen == gen + 1
    assert all(pm.pool.ref(p) == 1 for p in b.pages)
    pm.check_integrity([b], [])
    pm.release(b)
    assert b.pages == [] and b.num_computed_tokens == 0
    pm.check_integrity([], [])


def test_growth_evicts_cache_leaves_and_the_reserve_is_kept():
    pm = make(num_pages=4)
    a = req(list(range(16)))
    computed(pm, a, 16)
    pm.release(a)
    assert pm.pool.num_free == 0 and pm.pool.num_cached == 4
    b = req(list(range(100, 112)))
    assert not pm.alloc_with_reserve(b, 12, reserve=2)  # 3 pages + 2 reserved > 4
    assert b.pages == []
    assert pm.try_grow(b, 12)  # evicts the cached leaf
    assert len(b.pages) == 3 and pm.pool.num_held == 3
    assert not pm.try_grow(b, 20)  # 5 pages: more than the pool has
    pm.check_integrity([b], [])


def test_caching_adopts_the_trees_copy_of_an_equal_prefix():
    pm = make()
    a, b = req(list(range(8))), req(list(range(8)))
    computed(pm, a, 8)
    assert pm.try_grow(b, 8)
    own, gen = list(b.pages), b.page_gen
    b.num_computed_tokens = 8
    pm.cache_computed(b)
    assert b.pages == a.pages != own and b.page_gen == gen + 1
    assert all(pm.pool.is_free(p) for p in own)
    pm.check_integrity([a, b], [])


def test_a_branch_shares_its_parents_full_pages():
    pm = make()
    parent = req(list(range(10)))
    computed(pm, parent, 10)
    dst = pm.alloc_one()
    child = req(list(range(10)))
    child.pages = [dst]
    pm.share_prefix(parent, child, dst)
    assert child.pages == parent.pages[:2] + [dst] and child.num_computed_tokens == 10
    assert [pm.pool.ref(p) for p in parent.pages[:2]] == [2, 2]
    pm.check_integrity([parent, child], [])


def test_the_ref_count_check_catches_a_leaked_page():
    pm = make()
    a = req(list(range(6)))
    assert pm.try_grow(a, 6)
    with pytest.raises(AssertionError, match="ref 1 but held by 0"):
        pm.check_integrity([], [])


def test_trim_frees_the_pages_past_the_sequence():
    pm = make()
    a = req(list(range(5)))
    assert pm.try_grow(a, 13)  # room for a draft: 4 pages
    gen = a.page_gen
    pm.trim(a)  # 5 tokens need 2 pages
    assert len(a.pages) == 2 and a.page_gen == gen + 1 and pm.pool.num_held == 2
    pm.check_integrity([a], [])


def test_trim_never_leaves_the_next_token_to_write_into_a_shared_page():
    """A rolled-back branch of a page-aligned prompt recomputes its last prompt token: that
    page is shared with its sibling, so it gets a fresh one and computes the page again."""
    pm = make()
    parent = req(list(range(8)))
    computed(pm, parent, 8)
    child = req(list(range(8)))
    pm.share_prefix(parent, child, None)
    assert child.pages == parent.pages and pm.pool.ref(child.pages[1]) == 2
    child.num_computed_tokens = 7  # its last token is to be computed again
    gen = child.page_gen
    pm.trim(child)
    assert child.pages == parent.pages[:1] and child.num_computed_tokens == 4
    assert child.page_gen == gen + 1 and pm.pool.ref(parent.pages[1]) == 1
    pm.check_integrity([parent, child], [])
    pm.trim(parent)  # its own pages: nothing to do
    assert len(parent.pages) == 2 and parent.num_computed_tokens == 8


class _Backtracking:
    """A matcher whose dead ends may roll tokens back (what `tree_limit` asks)."""

    can_backtrack = True


def test_tokens_a_dead_end_may_roll_back_stay_out_of_the_tree():
    """Held tokens (`req.held`) and the page of the token before them are never cached nor
    matched; once the request is finished they may be."""
    pm = make()
    a = req(list(range(6)))
    a.token_ids += [6, 7, 8, 9, 10, 11]  # 6 output tokens, the last 3 held back
    a.grammar = _Backtracking()
    a.held = [("", None)] * 3
    assert a.num_final_tokens == 9 and pm.tree_limit(a) == 8
    computed(pm, a, 12)
    assert pm.cache.match_prefix(a.token_ids).num_tokens == 8  # not 12: two pages of three
    assert len(pm.usable_prefix(a)) == 8
    a.held = []  # released: all final (the page of the last token still waits for its logits)
    pm.cache_computed(a)
    assert pm.cache.match_prefix(a.token_ids).num_tokens == 8
    assert len(pm.usable_prefix(a)) == 11
    pm.check_integrity([a], [])
