"""HybridBlockPool alone: window pages attached to full pages, released, retained by the tree,
evicted least recently released first; its integrity check catches a corrupted map."""

from __future__ import annotations

import pytest

from radixlm.radix import HybridBlockPool, OutOfPagesError


def test_alloc_attaches_a_window_page_to_each_full_page():
    pool = HybridBlockPool(8, 4, page_size=2, window=3)
    pages = pool.alloc(3)
    windows = [pool.swa_map[p] for p in pages]
    assert sorted(windows) == [0, 1, 2] and pool.windows.num_held == 3
    assert pool.num_free == 1  # 5 full pages free, but one window page
    with pytest.raises(OutOfPagesError):
        pool.alloc(2)
    pool.check_integrity()


def test_released_window_page_is_freed_unless_the_tree_retains_it():
    pool = HybridBlockPool(8, 4, page_size=2, window=3)
    a, b = pool.alloc(2)
    pool.mark_in_tree(a, True)  # a is cached in the tree: its window page is retained
    pool.decref_swa([a, b])
    assert pool.swa_map[b] == pool.NO_SWA  # private: freed at once, a tombstone
    assert pool.swa_map[a] != pool.NO_SWA and pool.num_swa_cached == 1
    pool.check_integrity()
    pool.decref([a, b])  # a stays cached in the tree with its window page; b is free
    assert pool.is_free(b) and not pool.is_free(a)
    pool.mark_in_tree(a, False)  # evicted from the tree: both of its pages are freed
    assert pool.is_free(a) and pool.swa_map[a] == pool.NO_SWA
    assert pool.windows.num_free == 4 and pool.num_swa_cached == 0
    pool.check_integrity()


def test_evict_swa_frees_the_least_recently_released_first_and_alloc_uses_it():
    pool = HybridBlockPool(8, 3, page_size=2, window=3)
    pages = pool.alloc(3)
    for p in pages:
        pool.mark_in_tree(p, True)
    for p in (pages[1], pages[0], pages[2]):  # released in this order
        pool.decref_swa([p])
    assert pool.evict_swa(1) == 1 and pool.swa_map[pages[1]] == pool.NO_SWA
    assert pool.num_free == 3  # 5 full pages, 1 free + 2 cached window pages
    (new,) = pool.alloc(1)  # a free window page: nothing evicted
    assert pool.swa_map[pages[0]] != pool.NO_SWA
    pool.alloc(1)  # none free: the oldest cached one (pages[0]'s) is evicted
    assert pool.swa_map[pages[0]] == pool.NO_SWA and pool.swa_map[pages[2]] != pool.NO_SWA
    assert pool.swa_evicted == 2
    pool.check_integrity()


def test_a_held_window_page_is_never_evicted():
    pool = HybridBlockPool(4, 2, page_size=2, window=3)
    a, b = pool.alloc(2)
    pool.mark_in_tree(a, True)
    assert pool.evict_swa(2) == 0
    with pytest.raises(OutOfPagesError):
        pool.alloc(1)
    pool.check_integrity()


def test_valid_prefix_pages_needs_the_window_before_the_cut():
    pool = HybridBlockPool(8, 8, page_size=2, window=3)
    pages = pool.alloc(5)
    for p in pages:
        pool.mark_in_tree(p, True)
    pool.decref_swa(pages)
    assert pool.valid_prefix_pages(pages) == 5
    # a query at position 2m sees keys > 2m - 3: pages (2m - 2) // 2 .. m - 1
    pool.evict_swa(2)  # pages 0 and 1 (released first) lose their window part
    assert pool.valid_prefix_pages(pages) == 5  # page 4's query needs pages 3, 4 only
    assert pool.valid_prefix_pages(pages[:2]) == 0
    assert pool.valid_prefix_pages(pages[:3]) == 3  # needs page 2 only (keys > 3)
    pool.check_integrity()


def test_integrity_check_catches_a_corrupted_map():
    pool = HybridBlockPool(4, 4, page_size=2, window=3)
    a, b = pool.alloc(2)
    pool.swa_map[a], pool.swa_map[b] = pool.swa_map[b], pool.swa_map[a]
    with pytest.raises(AssertionError, match="points elsewhere"):
        pool.check_integrity()
