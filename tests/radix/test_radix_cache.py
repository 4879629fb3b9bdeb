"""RadixCache: match, insert/adopt, split, namespaces, LRU eviction, stats, integrity."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import pytest

from radixlm.radix import BlockPool, RadixCache


def make(page_size: int = 1, num_pages: int = 16, enabled: bool = True) -> RadixCache:
    return RadixCache(BlockPool(num_pages, page_size), enabled=enabled)


def run_request(
    cache: RadixCache, tokens: Sequence[int], ns: Hashable | None = None, release: bool = True
) -> list[int]:
    """The scheduler's flow: match + lock, alloc the rest, insert_and_adopt full pages, release."""
    ps, pool = cache.page_size, cache.pool
    m = cache.match_prefix(tokens, ns)
    cache.lock(m.node)
    pages = m.pages + pool.alloc(-(-len(tokens) // ps) - len(m.pages))
    n = len(tokens) // ps
    pages[:n] = cache.insert_and_adopt(tokens[: n * ps], pages[:n], ns)
    if release:
        pool.decref(pages)
    cache.check_integrity()
    return pages


def test_empty_cache_misses() -> None:
    cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert (m.pages, m.num_tokens) == ([], 0)
    assert m.node.is_root
    cache.lock(m.node)  # locking the root holds nothing
    cache.unlock(m.node)
    cache.check_integrity()


def test_match_is_page_granular() -> None:
    cache = make(page_size=4)
    seq = list(range(12))
    pages = run_request(cache, seq)
    assert cache.match_prefix(seq).pages == pages
    assert cache.match_prefix(seq + [99]).num_tokens == 12
    m = cache.match_prefix(seq[:11])  # trailing partial page never matches
    assert (m.pages, m.num_tokens) == (pages[:2], 8)
    assert cache.match_prefix(seq[:3]).num_tokens == 0
    m = cache.match_prefix(seq[:6] + [99, 99])  # mismatch inside the second page
    assert (m.pages, m.num_tokens) == (pages[:1], 4)
    cache.check_integrity()


def test_match_inside_node_splits_and_lock_holds_exactly_the_match() -> None:
    cache = make(page_size=2)
    seq = [1, 2, 3, 4, 5, 6]
    pages = run_request(cache, seq)
    assert cache.stats().num_nodes == 1
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.pages == pages[:2] and m.node.pages == pages[:2]
    assert cache.stats().num_nodes == 2
    cache.lock(m.node)
    assert [cache.pool.ref(p) for p in pages] == [1, 1, 0]
    cache.unlock(m.node)
    assert [cache.pool.ref(p) for p in pages] == [0, 0, 0]
    assert cache.match_prefix(seq).pages == pages  # the split changed no content
    cache.check_integrity()


def test_peek_prefix_len_is_read_only() -> None:
    cache = make(page_size=2)
    run_request(cache, [1, 2, 3, 4, 5, 6])
    before = cache.stats()
    assert cache.peek_prefix_len([1, 2, 3, 4, 9, 9]) == 4
    assert cache.peek_prefix_len([1, 2, 3, 4, 5]) == 4
    assert cache.peek_prefix_len([1, 2, 3, 4, 5, 6, 7, 8]) == 6
    assert cache.peek_prefix_len([1, 2, 3, 4], "other") == 0
    assert cache.stats() == before  # no split, no hit/query counting
    assert make(enabled=False).peek_prefix_len([1, 2]) == 0
    cache.check_integrity()


def test_insert_splits_and_returns_tree_pages() -> None:
    cache = make(page_size=1)
    pool = cache.pool
    a = pool.alloc(4)
    assert cache.insert([1, 2, 3, 4], a) == a
    b = pool.alloc(4)
    tree = cache.insert([1, 2, 9, 9], b)
    assert tree == a[:2] + b[2:]
    assert cache.stats().num_nodes == 3
    assert all(pool.in_tree(p) for p in a + b[2:]) and not any(pool.in_tree(p) for p in b[:2])
    pool.decref(a + b)  # b[:2] were never adopted: they go back to the free list
    assert pool.num_free == 16 - 6 and pool.num_cached == 6
    cache.check_integrity()


def test_insert_and_adopt_swaps_duplicates() -> None:
    cache = make(page_size=2)
    pool = cache.pool
    first = run_request(cache, [1, 2, 3, 4], release=False)
    mine = pool.alloc(3)  # computed the same prefix privately, plus one new page
    held = cache.insert_and_adopt([1, 2, 3, 4, 5, 6], mine, None)
    assert held == first + [mine[2]]
    assert [pool.ref(p) for p in first] == [2, 2]
    assert pool.is_free(mine[0]) and pool.is_free(mine[1])
    pool.decref(first)
    pool.decref(held)
    assert pool.num_held == 0 and pool.num_cached == 3
    cache.check_integrity()


def test_insert_validates() -> None:
    cache = make(page_size=2)
    pool = cache.pool
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], pool.alloc(2))
    with pytest.raises(ValueError):
        cache.insert([1, 2], [pool.num_pages - 1])  # a free page cannot be adopted
    tree = run_request(cache, [1, 2], release=False)
    with pytest.raises(ValueError):
        cache.insert([7, 7], tree)  # a page already in the tree cannot be adopted twice
    [p] = pool.alloc(1)
    with pytest.raises(ValueError):
        cache.insert([8, 8, 9, 9], [p, p])
    assert cache.insert([], []) == []
    cache.check_integrity()


def test_namespaces_are_isolated() -> None:
    cache = make(page_size=1)
    a = run_request(cache, [1, 2, 3], ns="lora-a")
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    assert cache.match_prefix([1, 2, 3], "lora-b").num_tokens == 0
    assert cache.match_prefix([1, 2, 3], "lora-a").pages == a
    b = run_request(cache, [1, 2, 3])
    assert not set(a) & set(b)
    assert cache.page_map(None) == {(1,): b[0], (1, 2): b[1], (1, 2, 3): b[2]}
    assert cache.page_map("lora-a")[(1, 2, 3)] == a[2]
    cache.check_integrity()


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    cache = make(page_size=1)
    a = run_request(cache, [1, 1])
    b = run_request(cache, [2, 2])
    c = run_request(cache, [3, 3])
    cache.match_prefix([1, 1])  # A is now the most recent; B is the oldest
    assert cache.evict(2) == 2
    assert all(cache.pool.is_free(p) for p in b)
    assert cache.match_prefix([2, 2]).num_tokens == 0
    assert cache.evict(1) == 1  # C is older than A; its tail goes first
    assert cache.pool.is_free(c[1]) and not cache.pool.is_free(c[0])
    assert cache.match_prefix([3, 3]).pages == c[:1]
    assert all(cache.pool.page_state(p) == "cached" for p in a)
    cache.check_integrity()


def test_evict_climbs_to_parents_and_frees_everything() -> None:
    cache = make(page_size=2)
    run_request(cache, [1, 1, 2, 2])
    run_request(cache, [1, 1, 3, 3, 4, 4])
    assert cache.stats().num_nodes == 3
    assert cache.evictable_pages() == 4
    assert cache.evict(100) == 4
    assert cache.pool.num_free == cache.pool.num_pages
    assert cache.stats().num_nodes == 0 and cache.num_tree_pages == 0
    assert cache.evict(1) == 0
    cache.check_integrity()


def test_evict_never_frees_held_pages() -> None:
    cache = make(page_size=1)
    held = run_request(cache, [1, 2, 3], release=False)
    run_request(cache, [1, 2, 7, 8])
    run_request(cache, [5, 6])
    assert cache.evictable_pages() == 4
    assert cache.evict(100) == 4
    assert all(cache.pool.page_state(p) == "held" and cache.pool.in_tree(p) for p in held)
    assert cache.match_prefix([1, 2, 3]).pages == held
    cache.pool.decref(held)
    assert cache.evict(100) == 3
    cache.check_integrity()


def test_evict_takes_only_the_unreferenced_tail_of_a_leaf() -> None:
    cache = make(page_size=1)
    pages = run_request(cache, [1, 2, 3, 4], release=False)
    cache.pool.decref(pages[2:])  # the holder keeps only the first two pages
    assert cache.evictable_pages() == 2
    assert cache.evict(1) == 1  # fewer than the tail: take the very last page only
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages[:3]
    assert cache.evict(5) == 1
    assert cache.match_prefix([1, 2, 3, 4]).pages == pages[:2]
    cache.check_integrity()


def test_hit_statistics() -> None:
    cache = make(page_size=2)
    run_request(cache, [1, 2, 3, 4])  # queried 4, hit 0
    cache.match_prefix([1, 2, 3, 5])  # queried 4, hit 2
    s = cache.stats()
    assert (s.hit_tokens, s.queried_tokens) == (2, 8)
    assert s.hit_rate == pytest.approx(0.25)
    assert (s.total_tree_pages, s.cached_pages, s.protected_pages) == (2, 2, 0)
    cache.lock(cache.match_prefix([1, 2]).node)
    s = cache.stats()
    assert (s.cached_pages, s.protected_pages, s.num_nodes) == (1, 1, 2)
    assert make().stats().hit_rate == 0.0


def test_disabled_cache_shares_nothing() -> None:
    cache = make(page_size=1, enabled=False)
    pool = cache.pool
    pages = run_request(cache, [1, 2, 3], release=False)
    assert not any(pool.in_tree(p) for p in pages)
    assert cache.insert_and_adopt([1, 2, 3], pages) == pages
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    pool.decref(pages)
    assert pool.num_free == pool.num_pages
    assert cache.evict(10) == 0 and cache.evictable_pages() == 0
    assert cache.stats().total_tree_pages == 0
    cache.check_integrity()


def test_reset_flushes_cached_pages_and_refuses_when_held() -> None:
    cache = make(page_size=1)
    run_request(cache, [1, 2])
    held = run_request(cache, [3, 4], release=False)
    m = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.num_tree_pages == 4  # refused: nothing changed
    cache.check_integrity()
    cache.pool.decref(held)
    cache.reset()
    assert cache.pool.num_free == cache.pool.num_pages
    assert cache.match_prefix([1, 2]).num_tokens == 0
    with pytest.raises(ValueError):
        cache.lock(m.node)  # a node from before the flush
    cache.check_integrity()


def test_shared_system_prompt_flow() -> None:
    cache = make(page_size=2, num_pages=12)
    pool = cache.pool
    system = [9, 9, 8, 8]
    r1 = run_request(cache, system + [1, 1, 1], release=False)
    m = cache.match_prefix(system + [2, 2, 2])
    assert m.pages == r1[:2]
    r2 = run_request(cache, system + [2, 2, 2], release=False)
    assert r2[:2] == r1[:2] and [pool.ref(p) for p in r1[:2]] == [2, 2]
    pool.decref(r1)
    pool.decref(r2)
    assert pool.num_held == 0
    assert pool.num_pages - pool.num_free == pool.num_cached == 2 + 1 + 1  # partial pages freed
    assert cache.evict(pool.num_pages) == 4
    assert pool.num_free == pool.num_pages
    cache.check_integrity()


def _tree_page(cache: RadixCache) -> int:
    return next(p for p in range(cache.pool.num_pages) if cache.pool.in_tree(p))


def _first_leaf(cache: RadixCache):
    return next(iter(cache._leaves))


def _free_and_in_tree(cache: RadixCache) -> None:
    p = _tree_page(cache)
    cache.pool._free.append(p)
    cache.pool._is_free[p] = True


def _duplicate_page(cache: RadixCache) -> None:
    leaf = _first_leaf(cache)
    other = next(
        p for p in range(cache.pool.num_pages) if cache.pool.in_tree(p) and p not in leaf.pages
    )
    leaf.pages[-1] = other


CORRUPTIONS: dict[str, Callable[[RadixCache], None]] = {
    "page-free-and-in-tree": _free_and_in_tree,
    "page-twice-in-tree": _duplicate_page,
    "in-tree-flag-cleared": lambda c: c.pool._in_tree.__setitem__(_tree_page(c), False),
    "stray-in-tree-flag": lambda c: c.pool._in_tree.__setitem__(c.pool.alloc(1)[0], True),
    "key-length": lambda c: setattr(_first_leaf(c), "key", _first_leaf(c).key[:-1]),
    "empty-node": lambda c: (_first_leaf(c).pages.clear(), setattr(_first_leaf(c), "key", ())),
    "child-dict-key": lambda c: setattr(_first_leaf(c), "key", (7,) + _first_leaf(c).key[1:]),
    "invalid-page-id": lambda c: _first_leaf(c).pages.__setitem__(0, 10_000),
    "leaf-set": lambda c: c._leaves.clear(),
    "page-counter": lambda c: setattr(c, "_num_tree_pages", c._num_tree_pages + 1),
    "parent-pointer": lambda c: setattr(_first_leaf(c), "parent", None),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_integrity_catches_injected_corruption(name: str) -> None:
    cache = make(page_size=1)
    run_request(cache, [1, 2, 3])
    run_request(cache, [1, 2, 4, 5], release=False)
    cache.check_integrity()
    CORRUPTIONS[name](cache)
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_continuation_follows_the_most_recent_branch_after_the_whole_sequence():
    pool = BlockPool(32, 2)
    cache = RadixCache(pool)

    def cached(tokens: list[int]) -> None:
        held = cache.match_prefix(tokens).pages
        pages = pool.alloc(len(tokens) // 2 - len(held))
        cache.insert(tokens, held + pages)
        pool.decref(pages)

    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cached(a)
    assert cache.continuation([1, 2, 3], 10) == [4, 5, 6, 7, 8]  # inside a node, mid-page
    assert cache.continuation([1, 2, 3, 4], 2) == [5, 6]
    assert cache.continuation([1, 2, 9], 4) == []  # not all held
    assert cache.continuation(a, 4) == []  # nothing after it
    cached([1, 2, 3, 4, 9, 9, 10, 11])
    assert cache.continuation([1, 2, 3, 4], 10) == [9, 9, 10, 11]  # the most recent branch
    assert cache.continuation([1, 2, 3, 4, 9], 10) == [9, 10, 11]
    cache.match_prefix(a)
    assert cache.continuation([1, 2, 3, 4], 10) == [5, 6, 7, 8]
    assert cache.continuation([1, 2, 3, 4], 10, namespace="other") == []
    cache.check_integrity()
