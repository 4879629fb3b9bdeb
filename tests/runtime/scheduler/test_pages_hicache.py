"""PageManager over a second tier: the pages after the pool's match come back from the tier
(inserted into the tree, counted as hit), the reserve is kept, nothing leaks."""

from __future__ import annotations

from collections.abc import Sequence

from radixlm.radix import BlockPool, HiCache, HostTierStore, RadixCache
from radixlm.runtime.request import Request
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.pages import PageManager


class FakeIO:
    """Page contents: one opaque payload per pool page."""

    def __init__(self, num_pages: int) -> None:
        self.contents = [b""] * num_pages

    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        return [self.contents[p] for p in pages]

    def write_pages(self, pages: Sequence[int], payloads: Sequence[bytes]) -> None:
        for p, c in zip(pages, payloads, strict=True):
            self.contents[p] = c


def make(num_pages: int = 4, page_size: int = 4) -> tuple[PageManager, FakeIO]:
    pool = BlockPool(num_pages, page_size)
    cache = RadixCache(pool)
    io = FakeIO(num_pages)
    return PageManager(pool, cache, HiCache(cache, HostTierStore(1 << 20), io)), io


def req(prompt: list[int]) -> Request:
    return Request("r", prompt, SamplingParams(max_new_tokens=4))


def compute(pm: PageManager, io: FakeIO, r: Request, n: int) -> None:
    assert pm.try_grow(r, n)
    for i, p in enumerate(r.pages):
        io.contents[p] = f"page {i} of {r.token_ids[:4]}".encode()
    r.num_computed_tokens = n
    pm.cache_computed(r)
    pm.release(r)


def test_evicted_pages_come_back_from_the_tier() -> None:
    pm, io = make()
    a = req(list(range(17)))
    compute(pm, io, a, 16)  # 4 pages cached: the whole pool
    tree = pm.cache.page_map()
    expected = [io.contents[tree[tuple(range(4 * (i + 1)))]] for i in range(4)]
    b = req(list(range(100, 116)) + [7])
    compute(pm, io, b, 16)  # evicts all of a's pages into the tier
    assert pm.hicache is not None and pm.hicache.stats().pages == 4
    again = req(list(range(17)))
    assert pm.adopt_prefix(again) == 16  # usable: 16 of 17 tokens, all from the tier
    assert [io.contents[p] for p in again.pages] == expected
    assert again.num_computed_tokens == 16 and len(again.pages) == 4
    assert pm.cache.peek_prefix_len(list(range(17))) == 16  # inserted into the tree
    pm.check_integrity([again], [])
    s = pm.hicache.stats()
    assert (s.hit_tokens, s.loaded_pages) == (16, 4)
    pm.release(again)
    pm.check_integrity([], [])
    pm.cache.reset()
    pm.hicache.clear()
    assert pm.pool.num_free == pm.pool.num_pages and pm.hicache.stats().pages == 0


def test_load_keeps_the_reserve_and_partial_loads_are_consistent() -> None:
    pm, io = make()
    a = req(list(range(17)))
    compute(pm, io, a, 16)
    b = req(list(range(100, 116)) + [7])
    compute(pm, io, b, 16)
    again = req(list(range(17)))
    assert pm.adopt_prefix(again, reserve=3) == 4  # one page loaded, three kept free
    assert pm.pool.num_free >= 3
    pm.check_integrity([again], [])
    assert pm.alloc_with_reserve(again, 16, reserve=0)  # the rest is computed
    pm.check_integrity([again], [])
    pm.release(again)
    pm.check_integrity([], [])
