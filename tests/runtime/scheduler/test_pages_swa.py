"""PageManager over a `HybridBlockPool` (sliding-window layers): unit cases, and a state machine
of requests that are admitted on cached prefixes, computed in chunks (prefill into the tree,
decode privately), retracted, forked and finished, with eviction of pages and window pages.

The machine tracks what every page *holds*: a full page and a window page are stamped with the
(namespace, token prefix up to the page's end) of the request that computed them. After every
step: the pool's, the tree's and the window refs' integrity checks; every running request's
pages hold its own prefix, and its window pages hold it for every page its next query can see;
the window pages a request holds stay bounded by its window whatever its length; and when every
request is gone nothing is held.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.radix import HybridBlockPool, OutOfPagesError, RadixCache
from radixlm.runtime.request import Request
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.pages import PageManager


def make(num_pages: int = 16, num_swa: int = 6, page_size: int = 4, window: int = 6):
    pool = HybridBlockPool(num_pages, num_swa, page_size, window)
    return PageManager(pool, RadixCache(pool))


def req(prompt: list[int], rid: str = "r") -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=4))


def advance(pm: PageManager, r: Request, n: int, cache: bool = True) -> None:
    """`r` computes its next `n` tokens (as `Scheduler.update` does after a forward)."""
    assert pm.try_grow(r, r.num_computed_tokens + n)
    r.num_computed_tokens += n
    if cache:
        pm.cache_computed(r)
    pm.slide_window(r)


def test_window_pages_are_released_as_a_sequence_grows():
    pm = make(num_pages=32, num_swa=4, page_size=4, window=6)
    r = req(list(range(101)))
    for _ in range(100):  # 100 tokens one at a time, nothing cached: decode-like
        advance(pm, r, 1, cache=False)
        pm.check_integrity([r], [])
        # the next query sees keys > c - 6: at most 2 pages before the current one
        assert pm.pool.windows.num_held <= 3
    assert pm.pool.num_held == 25 and r.swa_start == pm.pool.first_needed_page(100)
    pm.release(r)
    pm.check_integrity([], [])
    assert pm.pool.num_held == 0 and pm.pool.windows.num_free == 4


def test_prefix_hit_is_cut_where_the_window_layers_lost_their_keys():
    pm = make(num_pages=32, num_swa=8, page_size=4, window=6)
    a = req(list(range(40)))
    advance(pm, a, 16)  # 4 pages in the tree, window parts retained
    advance(pm, a, 16)  # 8 pages; a's window slid past the first ones (cached, evictable)
    pm.release(a)
    assert pm.pool.num_swa_cached == 8
    pm.pool.evict_swa(3)  # the oldest: pages 0, 1, 2 become tombstones
    b = req(list(range(33)))
    assert pm.adopt_prefix(b) == 32  # the last page's next query needs pages 6, 7 only
    pm.check_integrity([b], [])
    pm.release(b)
    pm.pool.evict_swa(8)  # every window page gone: a hit needs the window before it
    c = req(list(range(33)))
    assert pm.adopt_prefix(c) == 0
    assert c.pages == []
    pm.check_integrity([c], [])


def test_a_tombstoned_tree_page_adopts_the_recomputed_window_page():
    pm = make(num_pages=16, num_swa=8, page_size=4, window=6)
    a = req(list(range(12)))
    advance(pm, a, 8)
    pm.release(a)
    pm.pool.evict_swa(8)  # tree pages 0, 1 have no window part now
    b = req(list(range(12)))
    assert pm.adopt_prefix(b) == 0
    advance(pm, b, 8)  # recomputed: the tree's pages win, b's window pages move onto them
    tree_pages = b.pages[:2]
    assert all(pm.pool.swa_map[p] != pm.pool.NO_SWA for p in tree_pages)
    pm.check_integrity([b], [])
    pm.release(b)
    pm.check_integrity([], [])


def test_window_pool_exhaustion_is_out_of_pages():
    pm = make(num_pages=16, num_swa=2, page_size=4, window=6)
    r = req(list(range(40)))
    assert not pm.try_grow(r, 12)  # 3 pages at once need 3 window pages
    with pytest.raises(OutOfPagesError):
        pm.pool.alloc(3)
    pm.check_integrity([], [])


NUM_TOKENS = st.integers(1, 9)


class HybridPagesMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(8, 40),
        num_swa=st.integers(4, 16),
        window=st.integers(1, 9),
    )
    def setup(self, page_size: int, num_pages: int, num_swa: int, window: int) -> None:
        self.pm = make(num_pages, num_swa, page_size, window)
        self.pool: HybridBlockPool = self.pm.pool  # type: ignore[assignment]
        self.ps = page_size
        self.running: list[Request] = []
        self.full: dict[int, tuple] = {}  # page -> (ns, prefix) it holds
        self.win: dict[int, tuple] = {}  # window page -> (ns, prefix) it holds
        self.next_id = 0

    # ------------------------------------------------------------------ helpers
    def stamp(self, r: Request, start: int, end: int) -> None:
        """The forward wrote tokens [start, end) of `r` into its pages (both kinds)."""
        for page_idx in range(start // self.ps, -(-end // self.ps)):
            prefix = (r.namespace, tuple(r.token_ids[: (page_idx + 1) * self.ps]))
            page = r.pages[page_idx]
            self.full[page] = prefix
            self.win[self.pool.swa_map[page]] = prefix

    def drop(self, r: Request) -> None:
        self.running.remove(r)

    # ------------------------------------------------------------------ rules
    @rule(
        tokens=st.lists(st.integers(0, 1), min_size=1, max_size=30),
        ns=st.sampled_from([None, "x"]),
    )
    def admit(self, tokens: list[int], ns) -> None:
        r = Request(f"r{self.next_id}", tokens, SamplingParams(max_new_tokens=4), namespace=ns)
        self.next_id += 1
        self.pm.adopt_prefix(r, reserve=0)
        self.running.append(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=NUM_TOKENS, decode=st.booleans())
    def compute(self, data, n: int, decode: bool) -> None:
        r = data.draw(st.sampled_from(self.running))
        while r.num_tokens < r.num_computed_tokens + n:
            r.token_ids.append(len(r.token_ids) % 2)  # generated tokens
        start = r.num_computed_tokens
        if not self.pm.try_grow(r, start + n):
            self.pm.cache_computed(r)  # retraction: its computed pages go to the tree
            self.pm.release(r)
            self.drop(r)
            return
        self.stamp(r, start, start + n)
        r.num_computed_tokens += n
        if not decode:
            self.pm.cache_computed(r)
        self.pm.slide_window(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), cache=st.booleans())
    def finish(self, data, cache: bool) -> None:
        r = data.draw(st.sampled_from(self.running))
        if cache and r.num_computed_tokens:
            self.pm.cache_computed(r)
        self.pm.release(r)
        self.drop(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self.running))
        total = parent.num_computed_tokens
        if total == 0:
            return
        child = Request(
            f"r{self.next_id}", list(parent.token_ids[:total]), parent.params,
            namespace=parent.namespace,
        )  # fmt: skip
        self.next_id += 1
        dst = None
        if total % self.ps:
            dst = self.pm.alloc_one()
            if dst is None:
                return
            child.pages = [dst]
            src = parent.pages[total // self.ps]
            self.full[dst] = self.full[src]
            self.win[self.pool.swa_map[dst]] = self.win[self.pool.swa_map[src]]
        self.pm.cache_computed(parent)
        self.pm.share_prefix(parent, child, dst)
        self.running.append(child)

    @rule(n=st.integers(1, 8))
    def evict_pages(self, n: int) -> None:
        self.pm.cache.evict(n)

    @rule(n=st.integers(1, 8))
    def evict_window_pages(self, n: int) -> None:
        self.pool.evict_swa(n)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "pm"):
            self.pm.check_integrity(self.running, [])

    @invariant()
    def pages_hold_their_prefix(self) -> None:
        if not hasattr(self, "pm"):
            return
        for r in self.running:
            c = r.num_computed_tokens
            for i in range(-(-c // self.ps)):
                want = (r.namespace, tuple(r.token_ids[: (i + 1) * self.ps]))
                # a partial page holds the computed part of its prefix
                got = self.full[r.pages[i]]
                assert got[0] == want[0] and got[1][: min(c, (i + 1) * self.ps)] == want[1][:c]
                if i >= self.pool.first_needed_page(c):
                    wgot = self.win[self.pool.swa_map[r.pages[i]]]
                    assert wgot[0] == want[0]
                    assert wgot[1][: min(c, (i + 1) * self.ps)] == want[1][:c]

    @invariant()
    def window_pages_held_are_bounded(self) -> None:
        if not hasattr(self, "pm"):
            return
        for r in self.running:
            held_window = len(r.pages) - r.swa_start
            # the window's pages, the partial one, and those grown but not computed (<= 9)
            bound = -(-self.pool.window // self.ps) + 1 + -(-9 // self.ps) + 1
            assert held_window <= bound, (held_window, bound)

    def teardown(self) -> None:
        if not hasattr(self, "pm"):
            return
        for r in list(self.running):
            self.pm.release(r)
        self.pm.check_integrity([], [])
        assert self.pool.num_held == 0 and self.pool.windows.num_held == 0


TestHybridPagesMachine = HybridPagesMachine.TestCase
TestHybridPagesMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
