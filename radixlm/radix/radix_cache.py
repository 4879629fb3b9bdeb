"""Radix tree of full token pages -> physical page ids, with LRU eviction.

Usage by the scheduler (one request; ``ps`` = page size):

1. admit: ``m = cache.match_prefix(prompt[:usable], ns)``; ``cache.lock(m.node)``;
   ``req.pages = m.pages + pool.alloc(k)``. ``lock`` is just one ``incref`` of each matched
   page, and those pages are also in ``req.pages``.
2. after computing ``n`` full pages:
   ``req.pages[:n] = cache.insert_and_adopt(tokens[: n * ps], req.pages[:n], ns)``.
3. finish/abort: step 2 for the full pages (if caching), then ``pool.decref(req.pages)``.
   That single decref also releases the lock of step 1: do *not* call ``unlock`` as well
   (``unlock`` exists for symmetry and for callers that hold only the matched prefix).
4. ``pool.alloc`` would fail: ``cache.evict(shortfall)`` and retry.

The tree never counts as a ref: a tree page whose ref drops to 0 becomes *cached*, and only
``evict`` / ``reset`` return it to the free list.

For live views (``radixlm.radix.summary``) every node also keeps, maintained incrementally in
O(depth) per insert / split / evict and never by a walk over the tree: ``subtree_pages``, its
``hits`` (matches that covered the whole node) and ``ranked``, its children sorted by weight, so
that the K heaviest children of any node are read in O(K).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from radixlm.radix.block_pool import BlockPool, _require

logger = logging.getLogger(__name__)

EvictListener = Callable[[Hashable | None, tuple[int, ...], list[int]], None]


@dataclass(eq=False)
class TreeNode:
    """One edge of the radix tree: ``key`` tokens stored in ``pages`` (``page_size`` each).

    Roots have an empty key and no pages. ``children`` is keyed by the child's first page of
    tokens. ``last_access`` is a logical clock; an ancestor is touched whenever a descendant is,
    so ``parent.last_access >= child.last_access`` always holds.

    Maintained for live views (checked by ``RadixCache.check_integrity``): ``subtree_pages`` =
    ``len(pages)`` + the children's ``subtree_pages``; ``ranked`` holds one
    ``(child.subtree_pages, child.uid, child)`` per child, sorted ascending (heaviest last);
    ``hits`` counts the ``match_prefix`` calls whose match covered this whole node (a root
    counts every query); ``last_access_s`` is the ``time.monotonic()`` of the last touch.
    """

    key: tuple[int, ...]
    pages: list[int]
    parent: TreeNode | None
    namespace: Hashable | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    last_access: int = 0
    uid: int = 0
    subtree_pages: int = 0
    hits: int = 0
    last_access_s: float = 0.0
    ranked: list[tuple[int, int, TreeNode]] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.key


@dataclass
class MatchResult:
    """Matched prefix: ``pages`` in order, ``num_tokens == len(pages) * page_size``.

    ``node`` is the deepest matched node (the namespace root on a miss); pass it to
    ``lock`` / ``unlock``. The path root..node holds exactly ``pages``.
    """

    pages: list[int]
    num_tokens: int
    node: TreeNode


@dataclass
class CacheStats:
    num_nodes: int
    cached_pages: int
    protected_pages: int
    total_tree_pages: int
    hit_tokens: int
    queried_tokens: int
    hit_rate: float


class RadixCache:
    """Prefix cache over a ``BlockPool``; one tree root per namespace (LoRA, cache salt...).

    Invariants (checked by ``check_integrity``): every tree page is marked ``in_tree`` in the
    pool and occurs exactly once in the tree; every non-root node has a non-empty key of
    ``len(pages) * page_size`` tokens; ``_leaves`` is exactly the set of non-root childless
    nodes; ``_num_tree_pages`` counts the tree's pages.
    """

    def __init__(self, pool: BlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.enabled = enabled
        self._roots: dict[Hashable | None, TreeNode] = {}
        self._leaves: set[TreeNode] = set()
        self._num_tree_pages = 0
        self._clock = 0
        self._hit_tokens = 0
        self._queried_tokens = 0
        self._num_nodes = 0
        self._evicted_pages = 0  # cumulative, for rates
        self._uids = itertools.count(1)
        # Called by ``evict`` with (namespace, prefix tokens ending with the victims' tokens,
        # victim pages) before the victims are freed, their contents intact (the second tier).
        self.evict_listener: EvictListener | None = None

    @property
    def num_tree_pages(self) -> int:
        """Pages the tree holds (cached or held), O(1)."""
        return self._num_tree_pages

    @property
    def num_nodes(self) -> int:
        """Non-root nodes, O(1)."""
        return self._num_nodes

    @property
    def evicted_pages(self) -> int:
        """Pages ``evict`` has freed since the cache was created (``reset`` not included)."""
        return self._evicted_pages

    def roots(self) -> dict[Hashable | None, TreeNode]:
        """The namespace roots (read-only view for summaries)."""
        return self._roots

    # ------------------------------------------------------------------ match / insert
    def match_prefix(
        self,
        tokens: Sequence[int],
        namespace: Hashable | None = None,
        limit: Callable[[list[int]], int] | None = None,
    ) -> MatchResult:
        """Longest prefix of ``tokens`` in the tree, in whole pages; touches the matched path.

        A match ending inside a node splits it, so that ``node`` ends exactly at the match.
        ``limit(pages)``: how many leading matched pages are usable (a hybrid pool's window
        layers may have lost the keys the next query needs); the match is cut there.
        """
        self._queried_tokens += len(tokens)
        root = self._root(namespace)
        if not self.enabled:
            return MatchResult([], 0, root)
        ps = self.page_size
        node, pages, pos = root, [], 0
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            n = self._common_pages(child, tokens, pos)
            pages.extend(child.pages[:n])
            pos += n * ps
            if n < len(child.pages):
                node = self._split(child, n)
                break
            node = child
        if limit is not None and (keep := limit(pages)) < len(pages):
            node = self._cut(node, len(pages) - keep)
            pages, pos = pages[:keep], keep * ps
        self._touch(node, hit=True)
        self._hit_tokens += pos
        return MatchResult(pages, pos, node)

    def _cut(self, node: TreeNode, drop: int) -> TreeNode:
        """The node ending ``drop`` pages above the end of ``node`` (splitting one if needed)."""
        while drop > 0:
            assert node.parent is not None
            if drop >= len(node.pages):
                drop -= len(node.pages)
                node = node.parent
            else:
                node, drop = self._split(node, len(node.pages) - drop), 0
        return node

    def peek_prefix_len(self, tokens: Sequence[int], namespace: Hashable | None = None) -> int:
        """Tokens ``match_prefix`` would match, read-only: no split, no LRU touch, no stats."""
        root = self._roots.get(namespace)
        ps, node, pos = self.page_size, root, 0
        while self.enabled and node is not None and pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            n = self._common_pages(child, tokens, pos)
            pos += n * ps
            node = child if n == len(child.pages) else None
        return pos

    def continuation(
        self, tokens: Sequence[int], limit: int, namespace: Hashable | None = None
    ) -> list[int]:
        """Up to ``limit`` tokens the tree holds right after the whole of ``tokens`` (another
        sequence computed this prefix and went on: a repeated program, an agent loop, a fork),
        following the most recently used branch; empty when the tree does not hold all of
        ``tokens``. Read-only: no split, no LRU touch, no stats."""
        root = self._roots.get(namespace)
        if not self.enabled or root is None or limit <= 0:
            return []
        ps, node, pos, offset = self.page_size, root, 0, 0  # offset: tokens of node.key used
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                return []
            n = self._common_pages(child, tokens, pos)
            node, pos, offset = child, pos + n * ps, n * ps
            if n < len(child.pages):
                break
        tail = tuple(tokens[pos:])  # < one page, or the rest after a partial node match
        if offset < len(node.key):
            if node.key[offset : offset + len(tail)] != tail:
                return []
            out = list(node.key[offset + len(tail) :])
        else:
            nxt = [c for c in node.children.values() if c.key[: len(tail)] == tail]
            if not nxt:
                return []
            node = max(nxt, key=lambda c: c.last_access)
            out = list(node.key[len(tail) :])
        while len(out) < limit and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            out.extend(node.key)
        return out[:limit]

    def insert(
        self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable | None = None
    ) -> list[int]:
        """Insert full pages; return the pages the tree holds for the whole sequence.

        Where the tree already has a page for a position, the tree's page wins; the rest of the
        caller's pages are adopted (``mark_in_tree``), which requires each to be held and not
        already in the tree. The caller should swap its duplicates (see ``insert_and_adopt``).
        Disabled: adopts nothing and returns ``list(pages)``.
        """
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(
                f"insert needs whole pages: {len(tokens)} tokens for {len(pages)} pages of {ps}"
            )
        if not self.enabled:
            return list(pages)
        node, out, p = self._root(namespace), [], 0
        while p < len(pages):
            child = node.children.get(tuple(tokens[p * ps : (p + 1) * ps]))
            if child is None:
                self._add_leaf(node, tuple(tokens[p * ps :]), list(pages[p:]))
                out.extend(pages[p:])
                node = node.children[tuple(tokens[p * ps : (p + 1) * ps])]
                break
            n = self._common_pages(child, tokens, p * ps)
            out.extend(child.pages[:n])
            p += n
            node = self._split(child, n) if n < len(child.pages) else child
        self._touch(node)
        return out

    def insert_and_adopt(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        namespace: Hashable | None = None,
        swa_from: int | None = None,
    ) -> list[int]:
        """``insert``, then swap the caller's duplicates for the tree's pages.

        The caller holds one ref on each of ``pages``; afterwards it holds one ref on each page
        of the returned list instead (tree pages increfed, its own duplicates decrefed, which
        frees them since they are not in the tree). ``swa_from`` (a ``HybridBlockPool``): the
        caller also holds the window part of ``pages[swa_from:]``, swapped the same way.
        """
        tree_pages = self.insert(tokens, pages, namespace)
        if swa_from is not None:
            pairs = zip(pages[swa_from:], tree_pages[swa_from:])
            moves = [(own, t) for own, t in pairs if t != own]
            if moves:
                self.pool.move_swa(moves)
        take = [t for t, own in zip(tree_pages, pages, strict=True) if t != own]
        drop = [own for t, own in zip(tree_pages, pages, strict=True) if t != own]
        # NOTE: incref before decref so that no page is ever transiently unreferenced.
        self.pool.incref(take)
        self.pool.decref(drop)
        return tree_pages

    # ------------------------------------------------------------------ lock
    def lock(self, node: TreeNode) -> None:
        """Incref every page on the path root..node: the caller now holds the matched prefix."""
        self.pool.incref(self._path_pages(node))

    def unlock(self, node: TreeNode) -> None:
        """Decref every page on the path root..node (the inverse of ``lock``)."""
        self.pool.decref(self._path_pages(node))

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unreferenced pages, least-recently-used leaves first.

        Removes a leaf's maximal tail of ref-0 pages (only part of it if fewer are needed);
        a parent left childless joins the heap. Never frees a page with ref > 0.
        Returns the number of pages freed. O(leaves + k log leaves).
        """
        if num_pages <= 0 or not self._leaves:
            return 0
        tie = itertools.count()
        heap = [(n.last_access, next(tie), n) for n in self._leaves if self._free_tail(n) > 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            take = min(self._free_tail(node), num_pages - freed)
            victims = node.pages[-take:]
            self._notify_evict(node, victims)
            if take == len(node.pages):
                parent = self._remove_leaf(node)
                if not parent.is_root and not parent.children and self._free_tail(parent) > 0:
                    heapq.heappush(heap, (parent.last_access, next(tie), parent))
            else:
                del node.pages[-take:]
                node.key = node.key[: len(node.pages) * self.page_size]
                self._num_tree_pages -= take
                self._reweigh(node, -take)
            for page in victims:
                self.pool.mark_in_tree(page, False)
            freed += take
        self._evicted_pages += freed
        return freed

    def evictable_pages(self) -> int:
        """Pages ``evict`` could free right now (O(tree))."""
        total = 0
        cleared: dict[TreeNode, bool] = {}
        for node in reversed(list(self._nodes())):  # children before parents
            if node.is_root:
                continue
            tail = self._free_tail(node) if all(cleared[c] for c in node.children.values()) else 0
            cleared[node] = tail == len(node.pages)
            total += tail
        return total

    def reset(self) -> None:
        """Drop every cached page. Raises ``RuntimeError`` (changing nothing) if any is held."""
        held = [p for n in self._nodes() for p in n.pages if self.pool.ref(p) > 0]
        if held:
            raise RuntimeError(f"cannot reset the radix cache: {len(held)} tree pages are held")
        for node in list(self._nodes()):
            for page in node.pages:
                self.pool.mark_in_tree(page, False)
        self._roots.clear()
        self._leaves.clear()
        self._num_tree_pages = 0
        self._num_nodes = 0

    # ------------------------------------------------------------------ introspection
    def hit_counters(self) -> tuple[int, int]:
        """``(hit_tokens, queried_tokens)`` since creation, O(1)."""
        return self._hit_tokens, self._queried_tokens

    def stats(self) -> CacheStats:
        """Tree occupancy and cumulative hit statistics (``reset`` keeps these), O(1).

        NOTE: the pool's cached pages are exactly the tree's ref-0 pages (pool invariant).
        """
        cached = self.pool.num_cached
        q = self._queried_tokens
        return CacheStats(
            num_nodes=self._num_nodes,
            cached_pages=cached,
            protected_pages=self._num_tree_pages - cached,
            total_tree_pages=self._num_tree_pages,
            hit_tokens=self._hit_tokens,
            queried_tokens=q,
            hit_rate=self._hit_tokens / q if q else 0.0,
        )

    def page_map(self, namespace: Hashable | None = None) -> dict[tuple[int, ...], int]:
        """Every page-aligned prefix in the namespace's tree -> the page holding its last page."""
        out: dict[tuple[int, ...], int] = {}
        root = self._roots.get(namespace)
        stack = [(root, ())] if root is not None else []
        ps = self.page_size
        while stack:
            node, prefix = stack.pop()
            for i, page in enumerate(node.pages):
                out[prefix + node.key[: (i + 1) * ps]] = page
            stack.extend((c, prefix + node.key) for c in node.children.values())
        return out

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless tree and pool agree (see the class invariants)."""
        pool, ps = self.pool, self.page_size
        pool.check_integrity()
        seen: set[int] = set()
        leaves: set[TreeNode] = set()
        for ns, root in self._roots.items():
            _require(root.is_root and not root.pages, f"root of namespace {ns!r} is malformed")
            _require(root.namespace == ns, f"root of namespace {ns!r} has wrong namespace")
        for node in self._nodes():
            for first, child in node.children.items():
                _require(child.parent is node, f"child {first} does not point back to its parent")
                _require(child.key[:ps] == first, f"child keyed {first} starts {child.key[:ps]}")
                _require(
                    child.last_access <= node.last_access, f"child {first} newer than its parent"
                )
            weights = sum(c.subtree_pages for c in node.children.values())
            _require(
                node.subtree_pages == len(node.pages) + weights,
                f"node {node.key[:ps]} subtree_pages {node.subtree_pages} != "
                f"{len(node.pages)} + {weights}",
            )
            expected_rank = sorted((c.subtree_pages, c.uid) for c in node.children.values())
            _require(
                [(w, u) for w, u, _ in node.ranked] == expected_rank
                and all(c.parent is node for _, _, c in node.ranked),
                f"node {node.key[:ps]} ranked children out of sync",
            )
            if node.is_root:
                continue
            if not node.children:
                leaves.add(node)
            _require(len(node.pages) > 0, f"node {node.key[:ps]} has no pages")
            _require(
                len(node.key) == len(node.pages) * ps,
                f"node key length {len(node.key)} != {len(node.pages)} pages * {ps}",
            )
            for page in node.pages:
                _require(0 <= page < pool.num_pages, f"tree holds invalid page id {page}")
                _require(page not in seen, f"page {page} appears twice in the tree")
                seen.add(page)
                _require(pool.in_tree(page), f"tree page {page} is not marked in_tree")
                _require(not pool.is_free(page), f"tree page {page} is in the free list")
        marked = sum(1 for p in range(pool.num_pages) if pool.in_tree(p))
        _require(marked == len(seen), f"{marked} pages marked in_tree, tree holds {len(seen)}")
        _require(leaves == self._leaves, "leaf set out of sync with the tree")
        num_nodes = sum(1 for n in self._nodes() if not n.is_root)
        _require(self._num_nodes == num_nodes, f"node counter {self._num_nodes} != {num_nodes}")
        _require(
            self._num_tree_pages == len(seen),
            f"tree page counter {self._num_tree_pages} != actual {len(seen)}",
        )

    # ------------------------------------------------------------------ internals
    def _root(self, namespace: Hashable | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode((), [], None, namespace, uid=next(self._uids))
        return root

    def _common_pages(self, child: TreeNode, tokens: Sequence[int], pos: int) -> int:
        """Whole pages of ``child`` matching ``tokens[pos:]`` (>= 1: the first is the dict key)."""
        ps, key = self.page_size, child.key
        most = min(len(child.pages), (len(tokens) - pos) // ps)
        n = 1
        while n < most:
            lo, hi = n * ps, (n + 1) * ps
            if tuple(tokens[pos + lo : pos + hi]) != key[lo:hi]:
                break
            n += 1
        return n

    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Cut ``node`` after ``n`` pages; return the new head (parent of the shortened node)."""
        ps, parent = self.page_size, node.parent
        assert parent is not None and 0 < n < len(node.pages)
        head = TreeNode(node.key[: n * ps], node.pages[:n], parent, node.namespace)
        head.uid = next(self._uids)
        head.last_access, head.last_access_s = node.last_access, node.last_access_s
        head.hits = node.hits  # every match that covered the node covered its head
        head.subtree_pages = node.subtree_pages
        _unrank(parent, node)
        parent.children[head.key[:ps]] = head
        node.key, node.pages, node.parent = node.key[n * ps :], node.pages[n:], head
        node.subtree_pages -= n
        head.children[node.key[:ps]] = node
        _rank(parent, head)
        _rank(head, node)
        self._num_nodes += 1
        return head

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError(f"insert got duplicate page ids: {pages}")
        for page in pages:
            if self.pool.ref(page) == 0 or self.pool.in_tree(page):
                raise ValueError(f"cannot adopt page {page}: not held, or already in the tree")
        for page in pages:
            self.pool.mark_in_tree(page, True)
        leaf = TreeNode(key, pages, parent, parent.namespace, uid=next(self._uids))
        parent.children[key[: self.page_size]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._num_tree_pages += len(pages)
        self._num_nodes += 1
        leaf.subtree_pages = len(pages)
        _rank(parent, leaf)
        self._reweigh(parent, len(pages))

    def _remove_leaf(self, node: TreeNode) -> TreeNode:
        """Detach a childless node; return its parent (now possibly a leaf)."""
        parent = node.parent
        assert parent is not None and not node.children
        _unrank(parent, node)
        self._reweigh(parent, -node.subtree_pages)
        del parent.children[node.key[: self.page_size]]
        node.parent = None
        self._num_nodes -= 1
        self._leaves.discard(node)
        if not parent.children and not parent.is_root:
            self._leaves.add(parent)
        self._num_tree_pages -= len(node.pages)
        return parent

    def _notify_evict(self, node: TreeNode, victims: list[int]) -> None:
        """Tell the listener; a listener's failure never stops an eviction."""
        listener = self.evict_listener
        if listener is None:
            return
        parts: list[tuple[int, ...]] = []
        cur: TreeNode | None = node
        while cur is not None:
            parts.append(cur.key)
            cur = cur.parent
        prefix = tuple(t for key in reversed(parts) for t in key)
        try:
            listener(node.namespace, prefix, victims)
        except Exception:  # noqa: BLE001 - the listener is an optimization (the tier)
            logger.exception("radix cache eviction listener failed")

    def _free_tail(self, node: TreeNode) -> int:
        """Length of the node's maximal trailing run of ref-0 pages."""
        n = 0
        for page in reversed(node.pages):
            if self.pool.ref(page) > 0:
                break
            n += 1
        return n

    def _touch(self, node: TreeNode, hit: bool = False) -> None:
        self._clock += 1
        now = time.monotonic()
        cur: TreeNode | None = node
        while cur is not None:
            cur.last_access = self._clock
            cur.last_access_s = now
            cur.hits += hit
            cur = cur.parent

    def _reweigh(self, node: TreeNode, delta: int) -> None:
        """Add ``delta`` to the subtree_pages of ``node`` and its ancestors, keeping each
        parent's ``ranked`` sorted: O(depth * log(children))."""
        cur: TreeNode | None = node
        while cur is not None:
            parent = cur.parent
            if parent is not None:
                _unrank(parent, cur)
            cur.subtree_pages += delta
            if parent is not None:
                _rank(parent, cur)
            cur = parent

    def _path_pages(self, node: TreeNode) -> list[int]:
        out: list[list[int]] = []
        cur = node
        while cur.parent is not None:
            out.append(cur.pages)
            cur = cur.parent
        if self._roots.get(cur.namespace) is not cur:
            raise ValueError("node is no longer in the tree (evicted or reset)")
        return [p for pages in reversed(out) for p in pages]

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _rank(parent: TreeNode, child: TreeNode) -> None:
    bisect.insort(parent.ranked, (child.subtree_pages, child.uid, child))


def _unrank(parent: TreeNode, child: TreeNode) -> None:
    """Remove ``child``'s entry (keyed by its current weight) from ``parent.ranked``."""
    i = bisect.bisect_left(parent.ranked, (child.subtree_pages, child.uid))
    assert parent.ranked[i][2] is child, "ranked children out of sync"
    del parent.ranked[i]
