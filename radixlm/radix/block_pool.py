"""Physical KV pages: a free list and per-page reference counts.

Every page id in ``[0, num_pages)`` is in exactly one state:

- **free**: in the free list, ``ref == 0``, not in the radix tree;
- **held**: ``ref > 0`` (held by one or more running requests), in the tree or not;
- **cached**: in the tree with ``ref == 0`` (evictable by ``RadixCache.evict``).

``ref`` counts *requests* holding a page; the tree's own membership is the separate
``in_tree`` flag and never counts as a ref.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Literal

PageState = Literal["free", "held", "cached"]


class OutOfPagesError(RuntimeError):
    """Raised by ``BlockPool.alloc`` when fewer pages are free than requested."""


class BlockPool:
    """Fixed set of ``num_pages`` pages of ``page_size`` token slots each.

    Invariants (checked by ``check_integrity``): the free list has no duplicates; a page is in
    the free list iff ``_is_free[page]``; free pages have ``ref == 0`` and are not in the tree;
    a page with ``ref == 0`` that is not free is in the tree (nothing leaks);
    ``num_held == #pages with ref > 0``.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._ref: list[int] = [0] * num_pages
        self._in_tree: list[bool] = [False] * num_pages
        # NOTE: the free list is a stack; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free: list[bool] = [True] * num_pages
        self._num_held = 0

    # ------------------------------------------------------------------ counters
    @property
    def num_free(self) -> int:
        """Pages in the free list."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Pages with ref > 0 (maintained counter, O(1))."""
        return self._num_held

    @property
    def num_cached(self) -> int:
        """Pages in the tree with ref == 0."""
        return self.num_pages - len(self._free) - self._num_held

    # ------------------------------------------------------------------ queries
    def ref(self, page: int) -> int:
        """Number of requests holding ``page``."""
        self._check_id(page)
        return self._ref[page]

    def in_tree(self, page: int) -> bool:
        """Whether the radix tree holds ``page``."""
        self._check_id(page)
        return self._in_tree[page]

    def is_free(self, page: int) -> bool:
        """Whether ``page`` is in the free list."""
        self._check_id(page)
        return self._is_free[page]

    def page_state(self, page: int) -> PageState:
        """The page's state: ``"free"``, ``"held"`` or ``"cached"``."""
        self._check_id(page)
        if self._is_free[page]:
            return "free"
        return "held" if self._ref[page] > 0 else "cached"

    # ------------------------------------------------------------------ mutation
    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages off the free list, each with ref 1.

        Raises ``OutOfPagesError`` (allocating nothing) if ``n > num_free``.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages: {n}")
        if n > len(self._free):
            raise OutOfPagesError(f"requested {n} pages, only {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        # Ascending, whatever order the pages were freed in: the CPU attention op reads a
        # request's K/V page after page, and a run walked in address order streams faster than
        # the same pages walked backwards or scattered (`bench_cpu_attention_forward.py`: 32 x
        # 400 keys 14.0 ms scattered, 13.1 ascending; walked backwards, ~15% slower in a probe).
        pages.sort()
        for page in pages:
            self._is_free[page] = False
            self._ref[page] = 1
        self._num_held += n
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one ref per occurrence. A cached page becomes held; a free page raises.

        Validates every page before changing anything.
        """
        pages = list(pages)
        for page in pages:
            self._check_id(page)
            if self._is_free[page]:
                raise ValueError(f"incref of free page {page}")
        for page in pages:
            if self._ref[page] == 0:
                self._num_held += 1
            self._ref[page] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drop one ref per occurrence.

        A page whose ref hits 0 returns to the free list unless it is in the tree (then it
        becomes cached). Dropping below 0 raises; every page is validated before any change.
        """
        counts = Counter(pages)
        for page, count in counts.items():
            self._check_id(page)
            if self._ref[page] < count:
                ref = self._ref[page]
                raise ValueError(f"decref of page {page} by {count} but its ref is {ref}")
        for page, count in counts.items():
            self._ref[page] -= count
            if self._ref[page] == 0:
                self._num_held -= 1
                if not self._in_tree[page]:
                    self._push_free(page)

    def mark_in_tree(self, page: int, flag: bool) -> None:
        """Set the tree-membership flag (``RadixCache`` only).

        Marking a free page raises (the tree only adopts pages someone holds). Clearing the flag
        on a page with ref 0 returns it to the free list; clearing it on a held page leaves the
        page with its holders.
        """
        self._check_id(page)
        if flag:
            if self._is_free[page]:
                raise ValueError(f"cannot put free page {page} in the tree")
            self._in_tree[page] = True
            return
        if not self._in_tree[page]:
            return
        self._in_tree[page] = False
        if self._ref[page] == 0:
            self._push_free(page)

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if counters and page states disagree."""
        n = self.num_pages
        seen = [False] * n
        for page in self._free:
            _require(0 <= page < n, f"free list holds invalid page id {page}")
            _require(not seen[page], f"page {page} appears twice in the free list")
            seen[page] = True
            _require(self._is_free[page], f"page {page} is in the free list but not marked free")
            _require(self._ref[page] == 0, f"free page {page} has ref {self._ref[page]}")
            _require(not self._in_tree[page], f"free page {page} is marked in the tree")
        held = cached = 0
        for page in range(n):
            ref = self._ref[page]
            _require(ref >= 0, f"page {page} has negative ref {ref}")
            _require(
                self._is_free[page] == seen[page],
                f"page {page}: free flag {self._is_free[page]} but in free list {seen[page]}",
            )
            if ref > 0:
                held += 1
            elif not seen[page]:
                _require(self._in_tree[page], f"page {page} leaked: ref 0, not free, not in tree")
                cached += 1
        _require(held == self._num_held, f"num_held counter {self._num_held} != actual {held}")
        total = len(self._free) + held + cached
        _require(total == n, f"free + held + cached = {total} != num_pages {n}")

    # ------------------------------------------------------------------ helpers
    def _push_free(self, page: int) -> None:
        self._is_free[page] = True
        self._free.append(page)

    def _check_id(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page id {page} out of range [0, {self.num_pages})")


def _require(cond: bool, message: str) -> None:
    """``assert`` that survives ``python -O``."""
    if not cond:
        raise AssertionError(message)
