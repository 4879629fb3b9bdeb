"""A hybrid page pool for models with sliding-window layers (SGLang's SWA allocator).

Full-attention layers keep K/V for every position: their pages are this ``BlockPool``'s pages
("full pages"), exactly as for a dense model, and the radix tree, the requests' ``pages`` and
every ref count speak of them. Sliding-window layers need only the last W positions: their K/V
live in a second, smaller set of pages ("window pages", the ``windows`` pool), attached one to one
to full pages through ``swa_map`` (full page id -> window page id, or ``NO_SWA`` when the full
page's window part was released: a *tombstone* for the window layers).

Who holds a window page (``windows.ref``): the running requests whose window covers its full page
(a request holds the window part of ``pages[swa_start:]``). Its ``in_tree`` flag in the ``windows``
pool means *retained*: its full page is in the radix tree, so when no request holds it any more
it stays, cached and evictable (least recently released first, by ``evict_swa``), for prefix
hits. A window page that no request holds and the tree does not retain is freed at once.

Invariants (``check_integrity``): ``swa_map`` and ``_full_of`` are inverse on attached pages;
a window page is attached iff it is not free; a window page is retained iff its full page is in
the tree; a held window page's full page is held; the LRU is exactly the retained window pages
with ref 0; a free full page has no window page.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from radixlm.radix.block_pool import BlockPool, OutOfPagesError, _require


class HybridBlockPool(BlockPool):
    """Full pages (this pool) plus ``num_swa_pages`` window pages attached to them.

    ``swa_map`` is an ``array('i')`` of ``num_pages`` entries, written only here; the model
    runner reads it zero-copy (``torch.frombuffer``) to build the window layers' page table.
    ``NO_SWA`` (== ``num_swa_pages``) names the window buffers' extra scratch page, so a
    tombstone reads as zeros there and never indexes out of range.
    """

    def __init__(self, num_pages: int, num_swa_pages: int, page_size: int, window: int) -> None:
        if num_swa_pages < 1:
            raise ValueError(f"num_swa_pages must be >= 1, got {num_swa_pages}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(num_pages, page_size)
        self.window = window
        self.windows = BlockPool(num_swa_pages, page_size)
        self.NO_SWA = num_swa_pages
        self.swa_map = array("i", [num_swa_pages]) * num_pages
        self._full_of: list[int] = [-1] * num_swa_pages
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached window pages, oldest first
        self.swa_evicted = 0  # cumulative window pages freed by `evict_swa`

    # ------------------------------------------------------------------ counters
    @property
    def num_free(self) -> int:
        """Pages a caller can allocate now: full pages, each needing a window page (free, or
        cached and evicted on the way)."""
        return min(len(self._free), self.windows.num_free + len(self._lru))

    @property
    def num_free_full(self) -> int:
        """Full pages in the free list (evicting tree pages frees these, never window pages
        that ``num_free`` does not already count)."""
        return len(self._free)

    @property
    def num_swa_cached(self) -> int:
        """Window pages retained by the tree with no holder (evictable)."""
        return len(self._lru)

    # ------------------------------------------------------------------ the window's extent
    def first_needed_page(self, num_computed: int) -> int:
        """Index of the first page whose window part a sequence still needs when its next
        query is at position ``num_computed``: that query sees keys ``> num_computed - W``."""
        return max(0, num_computed - self.window + 1) // self.page_size

    def valid_prefix_pages(self, pages: Sequence[int]) -> int:
        """The most leading ``pages`` (a matched prefix) a request may start on: ``m`` such that
        the window pages its next query needs (``first_needed_page(m * ps) .. m - 1``) are all
        attached. 0 always qualifies."""
        ps, no = self.page_size, self.NO_SWA
        run = 0  # attached pages ending at index m - 1
        best = 0
        for m in range(1, len(pages) + 1):
            run = run + 1 if self.swa_map[pages[m - 1]] != no else 0
            if run >= m - self.first_needed_page(m * ps):
                best = m
        return best

    # ------------------------------------------------------------------ mutation
    def alloc(self, n: int) -> list[int]:
        """``n`` full pages (ref 1), each with a fresh window page (ref 1); evicts cached
        window pages when short. Raises ``OutOfPagesError`` (allocating nothing) otherwise."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages: {n}")
        if n > len(self._free) or n > self.windows.num_free + len(self._lru):
            raise OutOfPagesError(
                f"requested {n} pages; free: {len(self._free)} full, "
                f"{self.windows.num_free} + {len(self._lru)} cached window"
            )
        if n > self.windows.num_free:
            self.evict_swa(n - self.windows.num_free)
        pages = super().alloc(n)
        for page, s in zip(pages, self.windows.alloc(n), strict=True):
            self.swa_map[page] = s
            self._full_of[s] = page
        return pages

    def incref_swa(self, pages: Iterable[int]) -> None:
        """A request starts holding the window part of ``pages`` (each must be attached)."""
        swa = [self._attached(p) for p in pages]
        for s in swa:
            self._lru.pop(s, None)
        self.windows.incref(swa)

    def decref_swa(self, pages: Iterable[int]) -> None:
        """A request stops holding the window part of ``pages``: a window page nobody holds
        is cached if the tree retains it, else freed (its full page becomes a tombstone)."""
        swa = [self._attached(p) for p in pages]
        self.windows.decref(swa)
        for s in swa:
            if self.windows.ref(s) == 0:
                if self.windows.in_tree(s):
                    self._lru[s] = None
                    self._lru.move_to_end(s)
                else:
                    self._unmap(s)  # the pool freed it

    def move_swa(self, pairs: Iterable[tuple[int, int]]) -> None:
        """A request swaps its own page ``own`` for the tree's ``tree`` (same tokens) while
        holding the window part: it then holds ``tree``'s window page, which adopts ``own``'s
        when ``tree`` is a tombstone. Call before the full pages' incref / decref."""
        for own, tree in pairs:
            s_own = self._attached(own)
            if self.swa_map[tree] == self.NO_SWA:
                self.swa_map[own] = self.NO_SWA
                self.swa_map[tree] = s_own
                self._full_of[s_own] = tree
                if self._in_tree[tree]:
                    self.windows.mark_in_tree(s_own, True)
            else:
                self.incref_swa([tree])
                self.decref_swa([own])

    def mark_in_tree(self, page: int, flag: bool) -> None:
        """The tree retains a page's window part exactly while it holds the page."""
        s = self.swa_map[page]
        if s != self.NO_SWA:
            if flag:
                self.windows.mark_in_tree(s, True)
            elif self.windows.in_tree(s):
                self.windows.mark_in_tree(s, False)  # frees it when nobody holds it
                if self.windows.is_free(s):
                    self._lru.pop(s, None)
                    self._unmap(s)
        super().mark_in_tree(page, flag)

    def evict_swa(self, n: int) -> int:
        """Free up to ``n`` cached window pages, least recently released first (their full
        pages become tombstones). Returns the number freed."""
        freed = 0
        while freed < n and self._lru:
            s, _ = self._lru.popitem(last=False)
            self.windows.mark_in_tree(s, False)
            self._unmap(s)
            freed += 1
        self.swa_evicted += freed
        return freed

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        super().check_integrity()
        windows = self.windows
        windows.check_integrity()
        attached = 0
        for page in range(self.num_pages):
            s = self.swa_map[page]
            if s == self.NO_SWA:
                continue
            attached += 1
            _require(0 <= s < windows.num_pages, f"page {page} maps to invalid window page {s}")
            _require(self._full_of[s] == page, f"window page {s} of page {page} points elsewhere")
            _require(not self._is_free[page], f"free page {page} has window page {s}")
            _require(not windows.is_free(s), f"page {page} maps to free window page {s}")
            _require(
                windows.in_tree(s) == self._in_tree[page],
                f"window page {s} retained {windows.in_tree(s)} but page {page} in tree "
                f"{self._in_tree[page]}",
            )
            if windows.ref(s) > 0:
                _require(self._ref[page] > 0, f"window page {s} held but page {page} is not")
            _require(
                (s in self._lru) == (windows.ref(s) == 0),
                f"window page {s}: ref {windows.ref(s)} but in LRU {s in self._lru}",
            )
        _require(
            attached == windows.num_pages - windows.num_free,
            f"{attached} window pages attached, {windows.num_pages - windows.num_free} not free",
        )
        for s in range(windows.num_pages):
            if windows.is_free(s):
                _require(self._full_of[s] == -1, f"free window page {s} points to a page")

    # ------------------------------------------------------------------ helpers
    def _push_free(self, page: int) -> None:
        s = self.swa_map[page]
        if s != self.NO_SWA:  # only a cached one can be left: holders hold the full page too
            self._lru.pop(s, None)
            self.windows.mark_in_tree(s, False)
            self._unmap(s)
        super()._push_free(page)

    def _attached(self, page: int) -> int:
        self._check_id(page)
        s = self.swa_map[page]
        if s == self.NO_SWA:
            raise ValueError(f"page {page} has no window page (released)")
        return s

    def _unmap(self, s: int) -> None:
        page = self._full_of[s]
        self._full_of[s] = -1
        self.swa_map[page] = self.NO_SWA
