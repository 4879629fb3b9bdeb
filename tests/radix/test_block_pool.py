"""BlockPool: free list, ref counts, page states, and corruption detection."""

from __future__ import annotations

import pytest

from radixlm.radix import BlockPool, OutOfPagesError


def snapshot(pool: BlockPool) -> tuple[int, int, int, list[int], list[str]]:
    states = [pool.page_state(p) for p in range(pool.num_pages)]
    refs = [pool.ref(p) for p in range(pool.num_pages)]
    return pool.num_free, pool.num_held, pool.num_cached, refs, states


def test_fresh_pool_is_all_free() -> None:
    pool = BlockPool(8, 4)
    assert (pool.num_pages, pool.page_size) == (8, 4)
    assert (pool.num_free, pool.num_held, pool.num_cached) == (8, 0, 0)
    assert all(pool.page_state(p) == "free" for p in range(8))
    pool.check_integrity()


def test_alloc_gives_distinct_pages_with_ref_one() -> None:
    pool = BlockPool(8, 1)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert len(set(a + b)) == 8
    assert all(pool.ref(p) == 1 and pool.page_state(p) == "held" for p in a + b)
    assert (pool.num_free, pool.num_held, pool.num_cached) == (0, 8, 0)
    assert pool.alloc(0) == []
    pool.check_integrity()


def test_alloc_too_many_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, 2)
    pool.alloc(3)
    before = snapshot(pool)
    with pytest.raises(OutOfPagesError):
        pool.alloc(2)
    assert snapshot(pool) == before
    with pytest.raises(ValueError):
        pool.alloc(-1)
    assert isinstance(OutOfPagesError("x"), RuntimeError)
    pool.check_integrity()


def test_decref_to_zero_frees_and_pages_are_reused() -> None:
    pool = BlockPool(2, 1)
    pages = pool.alloc(2)
    pool.decref(pages)
    assert (pool.num_free, pool.num_held) == (2, 0)
    assert sorted(pool.alloc(2)) == sorted(pages)
    pool.check_integrity()


def test_incref_decref_counts() -> None:
    pool = BlockPool(4, 1)
    [p] = pool.alloc(1)
    pool.incref([p, p])
    assert pool.ref(p) == 3 and pool.num_held == 1
    pool.decref([p])
    pool.decref([p])
    assert pool.ref(p) == 1 and pool.page_state(p) == "held"
    pool.decref([p])
    assert pool.ref(p) == 0 and pool.page_state(p) == "free" and pool.num_held == 0
    pool.check_integrity()


def test_decref_below_zero_raises_atomically() -> None:
    pool = BlockPool(4, 1)
    a, b = pool.alloc(2)
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.decref([a, b, b])  # b has only one ref: nothing may change
    assert snapshot(pool) == before
    pool.decref([a])
    with pytest.raises(ValueError):
        pool.decref([a])


def test_incref_free_page_raises_atomically() -> None:
    pool = BlockPool(4, 1)
    [a] = pool.alloc(1)
    free_page = next(p for p in range(4) if pool.is_free(p))
    before = snapshot(pool)
    with pytest.raises(ValueError):
        pool.incref([a, free_page])
    assert snapshot(pool) == before


def test_bad_page_ids_raise() -> None:
    pool = BlockPool(4, 1)
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            pool.ref(bad)
        with pytest.raises(IndexError):
            pool.incref([bad])
        with pytest.raises(IndexError):
            pool.mark_in_tree(bad, True)


def test_in_tree_page_becomes_cached_then_free_on_unmark() -> None:
    pool = BlockPool(4, 1)
    [p] = pool.alloc(1)
    pool.mark_in_tree(p, True)
    assert pool.in_tree(p)
    pool.decref([p])
    assert pool.page_state(p) == "cached"
    assert (pool.num_free, pool.num_held, pool.num_cached) == (3, 0, 1)
    pool.check_integrity()
    pool.incref([p])  # a request re-uses a cached page
    assert pool.page_state(p) == "held" and pool.num_cached == 0
    pool.decref([p])
    pool.mark_in_tree(p, False)
    assert pool.page_state(p) == "free" and pool.num_free == 4
    pool.check_integrity()


def test_unmark_held_page_keeps_it_held() -> None:
    pool = BlockPool(4, 1)
    [p] = pool.alloc(1)
    pool.mark_in_tree(p, True)
    pool.mark_in_tree(p, False)
    assert pool.page_state(p) == "held" and not pool.is_free(p)
    pool.decref([p])
    assert pool.page_state(p) == "free"
    pool.check_integrity()


def test_cannot_put_free_page_in_tree() -> None:
    pool = BlockPool(4, 1)
    with pytest.raises(ValueError):
        pool.mark_in_tree(0, True)
    pool.check_integrity()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, 1)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda pool: pool._free.append(pool._free[0]), id="duplicate-free"),
        pytest.param(lambda pool: pool._ref.__setitem__(pool._free[0], 1), id="free-with-ref"),
        pytest.param(
            lambda pool: pool._in_tree.__setitem__(pool._free[0], True), id="free-in-tree"
        ),
        pytest.param(lambda pool: setattr(pool, "_num_held", pool._num_held + 1), id="held-count"),
        pytest.param(lambda pool: pool._free.pop(), id="leaked-page"),
        pytest.param(lambda pool: pool._is_free.__setitem__(0, True), id="free-flag-mismatch"),
        pytest.param(lambda pool: pool._ref.__setitem__(0, -1), id="negative-ref"),
        pytest.param(lambda pool: pool._free.append(99), id="invalid-free-id"),
    ],
)
def test_integrity_detects_corruption(corrupt) -> None:
    pool = BlockPool(6, 2)
    pages = pool.alloc(2)  # pages 0 and 1 held
    assert pages == [0, 1]
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()
