"""A bounded summary of the top of the radix tree, for live views (the `/dashboard`).

``summarize`` reads what ``RadixCache`` maintains incrementally (``subtree_pages``, ``hits``,
``ranked`` children) and visits only the nodes it returns: breadth-first from the namespace roots,
at most ``max_children`` heaviest children per node, ``max_depth`` levels and ``max_nodes`` nodes
in all. Its cost is O(returned nodes * (max_children + log)), whatever the size of the tree, so
the engine can take it under its lock. ``summarize_full`` computes the same summary by walking
the whole tree (weights and child order recomputed from scratch): the oracle for tests.

Privacy: a node's tokens are shown as a hash of its first page unless ``include_tokens`` is set
(the server's ``--dashboard-show-text``); then the first ``MAX_TOKENS_SHOWN`` token ids ride
along for the server to decode outside the lock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from radixlm.radix.radix_cache import RadixCache, TreeNode

MAX_TOKENS_SHOWN = 48


@dataclass(frozen=True)
class SummaryOptions:
    """How much of the tree a summary holds (each bound caps the work, not just the output)."""

    max_depth: int = 6  # levels below the namespace roots
    max_children: int = 8  # heaviest children shown per node
    max_nodes: int = 200  # nodes in all, roots included
    include_tokens: bool = False  # token ids of each edge's head (--dashboard-show-text)

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_children", "max_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class NodeSummary:
    """One node of the summary; ``parent`` is the parent's ``uid`` (None for a namespace root).

    ``state``: ``locked`` (every page held by a running request), ``evictable`` (no page held),
    ``partial`` (a held head, an evictable tail). ``other_children`` / ``other_tokens``: the
    children (and their subtrees' tokens) left out of the summary.
    """

    uid: int
    parent: int | None
    depth: int
    namespace: str
    tokens: int  # tokens on this edge
    prefix_tokens: int  # tokens from the root to the end of this edge
    pages: int
    subtree_tokens: int
    hits: int
    last_access_s: float  # time.monotonic() of the last match / insert through this node
    ref: int  # requests holding the node's first page
    state: str
    key_hash: str  # 8 hex digits of the edge's first page of token ids ("" for a root)
    other_children: int
    other_tokens: int
    head_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TreeSummary:
    nodes: tuple[NodeSummary, ...]  # breadth-first: parents before children
    num_nodes: int  # nodes in the whole tree (roots not counted)
    tree_pages: int
    page_size: int
    truncated: bool  # some node or level was left out


def namespace_label(ns: Hashable | None) -> str:
    return "default" if ns is None else str(ns)


def key_hash(tokens: Sequence[int]) -> str:
    """Stable short hash of token ids (the same in every process)."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=4).hexdigest()


def summarize(cache: RadixCache, options: SummaryOptions | None = None) -> TreeSummary:
    """The bounded summary from the cache's incrementally maintained fields."""
    return _build(cache, options or SummaryOptions(), _ranked_top, lambda n: n.subtree_pages)


def summarize_full(cache: RadixCache, options: SummaryOptions | None = None) -> TreeSummary:
    """The same summary by a full walk that trusts none of the maintained fields (O(tree))."""
    weights: dict[int, int] = {}
    for node in reversed(list(_all_nodes(cache))):  # children before parents
        weights[id(node)] = len(node.pages) + sum(weights[id(c)] for c in node.children.values())

    def top(node: TreeNode, k: int) -> tuple[list[TreeNode], int]:
        kids = sorted(node.children.values(), key=lambda c: (weights[id(c)], c.uid), reverse=True)
        return kids[:k], len(kids)

    return _build(cache, options or SummaryOptions(), top, lambda n: weights[id(n)])


def _ranked_top(node: TreeNode, k: int) -> tuple[list[TreeNode], int]:
    """The ``k`` heaviest children, heaviest first, and the number of children: O(k)."""
    ranked = node.ranked
    return [entry[2] for entry in ranked[: -k - 1 : -1]], len(ranked)


def _build(
    cache: RadixCache,
    options: SummaryOptions,
    top: Callable[[TreeNode, int], tuple[list[TreeNode], int]],
    weight: Callable[[TreeNode], int],
) -> TreeSummary:
    ps, pool = cache.page_size, cache.pool
    roots = sorted(cache.roots().values(), key=lambda r: (weight(r), r.uid), reverse=True)
    queue: deque[tuple[TreeNode, int | None, int, int]] = deque(
        (r, None, 0, 0) for r in roots[: options.max_nodes]
    )
    truncated = len(roots) > options.max_nodes
    budget = options.max_nodes - len(queue)
    out: list[NodeSummary] = []
    while queue:
        node, parent_uid, depth, prefix = queue.popleft()
        prefix += len(node.key)
        if depth < options.max_depth:
            kids, num_kids = top(node, min(options.max_children, budget))
        else:
            kids, num_kids = [], len(node.children)
        budget -= len(kids)
        truncated |= len(kids) < num_kids
        shown = sum(weight(c) for c in kids)
        child_weights = weight(node) - len(node.pages)
        first = pool.ref(node.pages[0]) if node.pages else 0
        last = pool.ref(node.pages[-1]) if node.pages else 0
        state = "locked" if last > 0 else "evictable" if first == 0 else "partial"
        head = None
        if options.include_tokens and node.key:
            head = tuple(node.key[:MAX_TOKENS_SHOWN])
        out.append(
            NodeSummary(
                uid=node.uid,
                parent=parent_uid,
                depth=depth,
                namespace=namespace_label(node.namespace),
                tokens=len(node.key),
                prefix_tokens=prefix,
                pages=len(node.pages),
                subtree_tokens=weight(node) * ps,
                hits=node.hits,
                last_access_s=node.last_access_s,
                ref=first,
                state=state if node.pages else "root",
                key_hash=key_hash(node.key[:ps]) if node.key else "",
                other_children=num_kids - len(kids),
                other_tokens=(child_weights - shown) * ps,
                head_token_ids=head,
            )
        )
        queue.extend((c, node.uid, depth + 1, prefix) for c in kids)
    return TreeSummary(
        nodes=tuple(out),
        num_nodes=cache.num_nodes,
        tree_pages=cache.num_tree_pages,
        page_size=ps,
        truncated=truncated,
    )


def _all_nodes(cache: RadixCache) -> list[TreeNode]:
    """Every node, parents before children (a full walk)."""
    out: list[TreeNode] = []
    stack = list(cache.roots().values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
