"""The bounded tree summary (`radixlm.radix.summary`) on a cache with known contents."""

from __future__ import annotations

import pytest

from radixlm.radix import BlockPool, RadixCache
from radixlm.radix.summary import SummaryOptions, key_hash, summarize, summarize_full


def _cache_with(seqs: list[list[int]], ps: int = 2, num_pages: int = 32) -> RadixCache:
    """Insert each sequence (whole pages) as a finished request would, leaving it cached."""
    pool = BlockPool(num_pages, ps)
    cache = RadixCache(pool)
    for seq in seqs:
        m = cache.match_prefix(seq)
        cache.lock(m.node)
        pages = m.pages + pool.alloc(len(seq) // ps - len(m.pages))
        pages = cache.insert_and_adopt(seq, pages)
        pool.decref(pages)
    cache.check_integrity()
    return cache


def _by_prefix(summary):
    return {n.prefix_tokens: n for n in summary.nodes}


def test_known_tree_shape_weights_and_hits() -> None:
    # root -> [1 2 3 4] -> {[5 6], [7 8 9 10]}; the second insert's match split the first leaf.
    cache = _cache_with([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9, 10]])
    cache.match_prefix([1, 2, 3, 4, 7, 8, 9, 10, 11])  # a hit on the long branch
    s = summarize(cache)
    assert s == summarize_full(cache)
    assert s.num_nodes == 3 and s.tree_pages == 5 and s.page_size == 2 and not s.truncated
    root, shared = s.nodes[0], s.nodes[1]
    assert root.parent is None and root.state == "root" and root.subtree_tokens == 10
    assert root.hits == 3  # every query counts at the root
    assert (shared.tokens, shared.pages, shared.subtree_tokens, shared.depth) == (4, 2, 10, 1)
    assert shared.parent == root.uid and shared.hits == 2  # the 2nd insert's match + the lookup
    by = _by_prefix(s)
    long, short = by[8], by[6]
    assert s.nodes.index(long) < s.nodes.index(short), "heaviest child first"
    assert (long.tokens, long.subtree_tokens, long.hits) == (4, 4, 1)
    assert (short.tokens, short.hits) == (2, 0)
    assert all(n.state == "evictable" and n.ref == 0 for n in s.nodes[1:])
    assert shared.key_hash == key_hash([1, 2]) and len(shared.key_hash) == 8
    assert all(n.head_token_ids is None for n in s.nodes), "no token ids by default"
    assert all(n.namespace == "default" for n in s.nodes)
    assert long.last_access_s >= short.last_access_s


def test_locked_partial_and_evictable_states() -> None:
    cache = _cache_with([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9, 10]])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 0])
    cache.lock(m.node)
    by = _by_prefix(summarize(cache))
    assert by[4].state == "locked" and by[4].ref == 1
    assert by[6].state == "locked" and by[8].state == "evictable"
    cache.unlock(m.node)
    # A held head and an evictable tail inside one node (a request holding part of it).
    long_branch = cache.match_prefix([1, 2, 3, 4, 7, 8, 9, 10]).pages[2:]
    cache.pool.incref(long_branch[:1])
    s = summarize(cache)
    assert _by_prefix(s)[8].state == "partial"
    assert s == summarize_full(cache)


def test_bounds_cut_work_and_report_what_is_left_out() -> None:
    seqs = [[1, 1] + [k] * 2 * (k + 1) for k in range(2, 7)]  # five branches, weights 3..7 pages
    cache = _cache_with(seqs, num_pages=64)
    full = summarize(cache)
    assert len(full.nodes) == 7 and not full.truncated
    s = summarize(cache, SummaryOptions(max_children=2))
    assert s == summarize_full(cache, SummaryOptions(max_children=2))
    shared = s.nodes[1]
    kids = [n for n in s.nodes if n.parent == shared.uid]
    assert [k.subtree_tokens for k in kids] == [14, 12]  # the two heaviest, heaviest first
    assert shared.other_children == 3 and shared.other_tokens == (10 + 8 + 6)
    assert s.truncated
    assert len(summarize(cache, SummaryOptions(max_depth=1)).nodes) == 2
    assert len(summarize(cache, SummaryOptions(max_nodes=3)).nodes) == 3


def test_namespaces_and_tokens_only_when_asked() -> None:
    pool = BlockPool(16, 2)
    cache = RadixCache(pool)
    pages = pool.alloc(2)
    cache.insert([9, 8, 7, 6], pages, namespace="lora-a")
    pool.decref(pages)
    s = summarize(cache, SummaryOptions(include_tokens=True))
    assert [n.namespace for n in s.nodes] == ["lora-a", "lora-a"]
    assert s.nodes[1].head_token_ids == (9, 8, 7, 6)
    assert s == summarize_full(cache, SummaryOptions(include_tokens=True))


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="max_children"):
        SummaryOptions(max_children=0)


def test_summary_cost_does_not_grow_with_the_tree() -> None:
    """A wide tree (2000 prompts) summarizes with max_nodes nodes, reading only those."""
    pool = BlockPool(4100, 1)
    cache = RadixCache(pool)
    for k in range(2000):
        pages = pool.alloc(2)
        cache.insert([k, k], pages)
        pool.decref(pages)
    s = summarize(cache, SummaryOptions(max_children=8, max_nodes=50))
    assert len(s.nodes) == 9 and s.nodes[0].other_children == 1992
    assert s == summarize_full(cache, SummaryOptions(max_children=8, max_nodes=50))
