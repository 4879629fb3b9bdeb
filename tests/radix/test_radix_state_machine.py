"""Stateful property test: RadixCache + BlockPool against a reference model.

Model: per namespace, a dict from every page-aligned cached token prefix to the page holding
its last page (what the tree must contain, exactly), plus the list of live requests and the
pages each holds (what the pool's ref counts must be, exactly). A tiny token alphabet makes
prefixes collide, so splits, shared pages and duplicate inserts happen constantly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixlm.radix import BlockPool, RadixCache

NAMESPACES = [None, "lora-a"]
namespaces = st.sampled_from(NAMESPACES)
token_lists = st.lists(st.integers(0, 1), max_size=12)

PrefixMap = dict[tuple[int, ...], int]


@dataclass
class Req:
    ns: Hashable | None
    tokens: list[int]
    pages: list[int]


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 24))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.pool = BlockPool(num_pages, page_size)
        self.cache = RadixCache(self.pool)
        self.model: dict[Hashable | None, PrefixMap] = {ns: {} for ns in NAMESPACES}
        self.reqs: list[Req] = []

    # ------------------------------------------------------------------ model helpers
    def expected_match(self, tokens: list[int], ns: Hashable | None) -> list[int]:
        tree, pages = self.model[ns], []
        while (len(pages) + 1) * self.ps <= len(tokens):
            page = tree.get(tuple(tokens[: (len(pages) + 1) * self.ps]))
            if page is None:
                break
            pages.append(page)
        return pages

    def checked_match(self, tokens: list[int], ns: Hashable | None):
        peek = self.cache.peek_prefix_len(tokens, ns)
        m = self.cache.match_prefix(tokens, ns)
        assert peek == m.num_tokens
        assert m.num_tokens == len(m.pages) * self.ps
        assert m.num_tokens <= len(tokens)
        assert m.pages == self.expected_match(tokens, ns)
        return m

    def checked_evict(self, k: int) -> int:
        cached_before = self.pool.num_cached
        freed = self.cache.evict(k)
        assert freed == min(max(k, 0), cached_before)
        assert self.pool.num_cached == cached_before - freed
        removed = 0
        for ns in NAMESPACES:
            old, new = self.model[ns], self.cache.page_map(ns)
            assert new.items() <= old.items(), "eviction invented or moved content"
            gone = [page for key, page in old.items() if key not in new]
            assert all(self.pool.is_free(p) for p in gone)
            removed += len(gone)
            self.model[ns] = new
        assert removed == freed
        return freed

    def adopt(self, req: Req) -> None:
        """insert_and_adopt the request's full pages, checking the result against the model."""
        n = len(req.tokens) // self.ps
        tree = self.model[req.ns]
        keys = [tuple(req.tokens[: (j + 1) * self.ps]) for j in range(n)]
        expected = [tree.get(key, own) for key, own in zip(keys, req.pages[:n], strict=True)]
        got = self.cache.insert_and_adopt(req.tokens[: n * self.ps], req.pages[:n], req.ns)
        assert got == expected
        tree.update(zip(keys, got, strict=True))
        req.pages[:n] = got

    # ------------------------------------------------------------------ rules
    @rule(ns=namespaces, tokens=token_lists)
    def start_request(self, ns: Hashable | None, tokens: list[int]) -> None:
        """Admit: match + lock, allocate the rest (evicting if short), or retract via unlock."""
        m = self.checked_match(tokens, ns)
        self.cache.lock(m.node)
        need = -(-len(tokens) // self.ps) - len(m.pages)
        if need > self.pool.num_free:
            self.checked_evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            self.cache.unlock(m.node)
            return
        self.reqs.append(Req(ns, tokens, m.pages + self.pool.alloc(need)))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 1_000))
    def chunk_done(self, i: int) -> None:
        """A running request caches its full pages and keeps running."""
        self.adopt(self.reqs[i % len(self.reqs)])

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 1_000), cache_it=st.booleans())
    def finish_request(self, i: int, cache_it: bool) -> None:
        req = self.reqs.pop(i % len(self.reqs))
        if cache_it:
            self.adopt(req)
        self.pool.decref(req.pages)

    @rule(ns=namespaces, tokens=token_lists)
    def lock_unlock(self, ns: Hashable | None, tokens: list[int]) -> None:
        m = self.checked_match(tokens, ns)
        before = [self.pool.ref(p) for p in m.pages]
        self.cache.lock(m.node)
        assert [self.pool.ref(p) for p in m.pages] == [r + 1 for r in before]
        self.cache.unlock(m.node)
        assert [self.pool.ref(p) for p in m.pages] == before

    @rule(k=st.integers(0, 30))
    def evict(self, k: int) -> None:
        self.checked_evict(k)

    @precondition(lambda self: not self.reqs)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        assert self.pool.num_free == self.pool.num_pages
        self.model = {ns: {} for ns in NAMESPACES}

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity()

    @invariant()
    def refs_are_exactly_the_requests(self) -> None:
        counts = Counter(p for req in self.reqs for p in req.pages)
        assert all(self.pool.ref(p) == counts[p] for p in range(self.pool.num_pages))
        assert self.pool.num_held == len(counts)

    @invariant()
    def tree_matches_model(self) -> None:
        for ns in NAMESPACES:
            tree = self.cache.page_map(ns)
            assert tree == self.model[ns]
            assert all(key[: -self.ps] in tree or len(key) == self.ps for key in tree)

    @invariant()
    def every_cached_page_is_evictable(self) -> None:
        assert self.cache.evictable_pages() == self.pool.num_cached

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        while self.reqs:
            self.finish_request(0, cache_it=True)
        self.checked_evict(self.pool.num_pages)
        assert self.pool.num_free == self.pool.num_pages
        assert self.cache.num_tree_pages == 0
        self.cache.check_integrity()


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestRadixStateMachine = RadixMachine.TestCase
