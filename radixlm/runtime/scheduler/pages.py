"""KV pages of requests: allocation (evicting cache leaves when short), release, caching
computed full pages in the radix tree, and (with a second tier) loading a prefix's tier pages.

NOTE: invariants kept here
- A request's `pages` are exactly the pages it holds one ref on; the full ones it shares with the
  tree form a root path, so releasing is one `pool.decref(req.pages)`.
- Only full pages are inserted into the tree; the partial last page stays private.
- Pages loaded from the second tier enter the tree at once, like computed ones; with
  write-through, every page the tree adopts is stored in the tier.
- `req.page_gen` is bumped whenever `pages` changes other than by appending (the executor's page
  table rewrites the row then).
- Tokens a dead end may still roll back (`tree_limit`) never enter the tree nor are matched in
  it, nor is the page of the token before them (a rollback recomputes that token: its page must
  be private).
- With a `HybridBlockPool` (sliding-window layers), a request also holds the window part of
  `pages[swa_start:]`; `slide_window` releases the pages its next query can no longer see, and a
  prefix hit is cut to where the window layers still hold what its next query needs.
"""

from __future__ import annotations

from radixlm.radix import BlockPool, HiCache, HybridBlockPool, RadixCache
from radixlm.runtime.request import Request
from radixlm.runtime.scheduler.tier_loads import TierLoads


class PageManager:
    def __init__(self, pool: BlockPool, cache: RadixCache, hicache: HiCache | None = None) -> None:
        self.pool = pool
        self.cache = cache
        self.hicache = hicache
        self.tier_loads = TierLoads(hicache) if hicache is not None else None
        self.page_size = pool.page_size
        self.hybrid = pool if isinstance(pool, HybridBlockPool) else None
        if self.hybrid is not None and hicache is not None:
            raise ValueError("the second KV tier does not move window-layer pages (hybrid pool)")

    @staticmethod
    def tree_limit(req: Request) -> int:
        """How many of `req`'s leading tokens may be in the tree: all, unless a dead end may
        still roll it back (a running request whose matcher can `backtrack`): then those
        before its last final token (`num_final_tokens`)."""
        g = req.grammar
        if g is None or not g.can_backtrack or req.is_finished:
            return req.num_tokens
        return req.num_final_tokens - 1

    @classmethod
    def usable_prefix(cls, req: Request) -> list[int]:
        """The tokens a prefix hit may cover: never the last (its logits are needed), nor the
        positions whose logits give wanted prompt logprobs, nor past `tree_limit`."""
        usable = min(req.num_tokens - 1, cls.tree_limit(req))
        if req.prompt_logprob_start is not None:
            usable = min(usable, max(0, req.prompt_logprob_start - 1))
        return req.token_ids[:usable]

    def tier_ready(self, req: Request) -> bool:
        """False while `req`'s pages are being read from the second tier in the background
        (the first call starts the read): admission skips it until then."""
        if self.tier_loads is None:
            return True
        tokens = self.usable_prefix(req)
        start = self.cache.peek_prefix_len(tokens, req.namespace)
        return self.tier_loads.ready(req, tokens, req.namespace, start)

    def adopt_prefix(self, req: Request, reserve: int = 0) -> int:
        """Start `req` on its longest cached prefix (locked, one ref per page); returns the
        tokens hit.

        With a second tier, the pages after the pool's match that the tier holds are loaded
        into fresh pool pages (leaving `reserve` free; read in the background beforehand when
        `tier_ready` was asked) and inserted into the tree: they count as hit like the pool's."""
        tokens = self.usable_prefix(req)
        if self.hybrid is None:
            m = self.cache.match_prefix(tokens, req.namespace)
        else:  # NOTE: the hit ends where the window layers still hold what its next query needs
            m = self.cache.match_prefix(tokens, req.namespace, self.hybrid.valid_prefix_pages)
        self.cache.lock(m.node)
        req.pages = list(m.pages)
        req.page_gen += 1
        req.num_computed_tokens = m.num_tokens
        if self.hybrid is not None:
            start = self.hybrid.first_needed_page(req.num_computed_tokens)
            req.swa_start = len(req.pages)  # no window page held until the incref succeeds
            self.hybrid.incref_swa(req.pages[start:])
            req.swa_start = start
        if self.hicache is not None:
            prefetched = self.tier_loads.take(req) if self.tier_loads is not None else None
            loaded = self.hicache.load(tokens, req.namespace, m.num_tokens, reserve, prefetched)
            if loaded:
                req.pages += loaded
                req.num_computed_tokens += len(loaded) * self.page_size
                self.cache_computed(req)
        return req.num_computed_tokens

    def alloc_with_reserve(self, req: Request, total_tokens: int, reserve: int) -> bool:
        """Pages for `total_tokens` in all, leaving `reserve` pages free (headroom for the
        running requests' growth); evicts when short. False: not enough even after eviction."""
        need = req.pages_needed(total_tokens, self.page_size)
        # NOTE: a hybrid pool short of window pages (held ones) gains nothing from evicting.
        free = self.pool.num_free if self.hybrid is None else self.hybrid.num_free_full
        short = need + reserve - free
        if short > 0:
            self.cache.evict(short)
        if need + reserve > self.pool.num_free:
            return False
        req.pages.extend(self.pool.alloc(need))
        return True

    def try_grow(self, req: Request, total_tokens: int) -> bool:
        """Pages for `total_tokens` in all, evicting cache leaves when short; False when the
        pool cannot provide them (the caller retracts someone and tries again)."""
        return self.alloc_with_reserve(req, total_tokens, 0)

    def alloc_one(self) -> int | None:
        """One free page (evicting a leaf if needed), or None."""
        if self.pool.num_free < 1:
            self.cache.evict(1)
        return self.pool.alloc(1)[0] if self.pool.num_free >= 1 else None

    def release(self, req: Request) -> None:
        """Drop every ref `req` holds; it restarts from zero computed tokens."""
        if self.hybrid is not None:
            self.hybrid.decref_swa(req.pages[req.swa_start :])
            req.swa_start = 0
        self.pool.decref(req.pages)
        req.pages = []
        req.page_gen += 1
        req.num_computed_tokens = 0

    def trim(self, req: Request) -> None:
        """Free the pages past those `req.token_ids` needs (a speculative draft's rejected
        tail, or tokens a dead end rolled back: private, never in the tree; their slots are
        written again when reached). The page the next computed token is written into must be
        `req`'s alone: when another request holds it too (n > 1 branches share the prompt's
        full pages), it is dropped and its tokens are computed again into a fresh page."""
        need = -(-req.num_tokens // self.page_size)
        if len(req.pages) > need:
            if self.hybrid is not None:
                self.hybrid.decref_swa(req.pages[max(need, req.swa_start) :])
            self.pool.decref(req.pages[need:])
            del req.pages[need:]
            req.page_gen += 1
        k = req.num_computed_tokens // self.page_size
        if k < len(req.pages) and self.pool.ref(req.pages[k]) > 1:
            if self.hybrid is not None:
                self.hybrid.decref_swa(req.pages[max(k, req.swa_start) :])
            self.pool.decref(req.pages[k:])
            del req.pages[k:]
            req.num_computed_tokens = k * self.page_size
            req.page_gen += 1

    def cache_computed(self, req: Request) -> None:
        """Insert the request's computed full pages into the tree (and adopt the tree's copies)."""
        num_full = min(req.num_computed_tokens, self.tree_limit(req)) // self.page_size
        if num_full == 0 or not self.cache.enabled:
            return
        tokens = req.token_ids[: num_full * self.page_size]
        swa_from = req.swa_start if self.hybrid is not None else None
        full = self.cache.insert_and_adopt(tokens, req.pages[:num_full], req.namespace, swa_from)
        if full != req.pages[:num_full]:
            req.pages[:num_full] = full
            req.page_gen += 1
        if self.hicache is not None and self.hicache.write_through:
            self.hicache.on_cached(req.namespace, tokens, full)

    def share_prefix(self, parent: Request, child: Request, dst: int | None) -> None:
        """A forked branch takes one ref on its parent's computed full pages, then its own copy
        `dst` of the partial page."""
        num_full = parent.num_computed_tokens // self.page_size
        self.pool.incref(parent.pages[:num_full])
        if self.hybrid is not None:  # `dst`'s window part is already the child's
            child.swa_start = parent.swa_start
            self.hybrid.incref_swa(parent.pages[parent.swa_start : num_full])
        child.pages = parent.pages[:num_full] + ([dst] if dst is not None else [])
        child.page_gen += 1
        child.num_computed_tokens = parent.num_computed_tokens

    def slide_window(self, req: Request) -> None:
        """Release the window part of the pages `req`'s next query can no longer see (a
        hybrid pool; no-op otherwise). Call after `num_computed_tokens` advanced."""
        if self.hybrid is None:
            return
        start = self.hybrid.first_needed_page(req.num_computed_tokens)
        if start > req.swa_start:
            self.hybrid.decref_swa(req.pages[req.swa_start : start])
            req.swa_start = start

    def capacity_error(self, req: Request) -> str:
        hybrid = self.hybrid
        swa = "" if hybrid is None else f" and {hybrid.windows.num_pages} window-layer pages"
        return (
            f"request {req.request_id} needs more KV cache than the whole pool holds "
            f"({req.num_tokens} tokens; pool: {self.pool.num_pages} pages{swa} of "
            f"{self.page_size})"
        )

    def check_integrity(self, running: list[Request], waiting: list[Request]) -> None:
        """Every page's ref count equals the number of running requests holding it."""
        self.cache.check_integrity()
        held: dict[int, int] = {}
        for req in running:
            for p in req.pages:
                held[p] = held.get(p, 0) + 1
        for req in waiting:
            assert not req.pages, f"waiting request {req.request_id} holds pages"
        for page in range(self.pool.num_pages):
            assert self.pool.ref(page) == held.get(page, 0), (
                f"page {page}: ref {self.pool.ref(page)} but held by {held.get(page, 0)} requests"
            )
        if self.hybrid is not None:
            self._check_window_refs(running)

    def _check_window_refs(self, running: list[Request]) -> None:
        """Every window page's ref equals the running requests holding its window part, and
        those hold all that their next query reads."""
        hybrid = self.hybrid
        assert hybrid is not None
        held: dict[int, int] = {}
        for req in running:
            need = hybrid.first_needed_page(req.num_computed_tokens)
            assert req.swa_start <= need, (
                f"request {req.request_id} released window pages it still needs "
                f"(swa_start {req.swa_start} > {need})"
            )
            for p in req.pages[req.swa_start :]:
                s = hybrid.swa_map[p]
                assert s != hybrid.NO_SWA, f"request {req.request_id} holds released page {p}"
                held[s] = held.get(s, 0) + 1
        windows = hybrid.windows
        for s in range(windows.num_pages):
            assert windows.ref(s) == held.get(s, 0), (
                f"window page {s}: ref {windows.ref(s)} but held by {held.get(s, 0)} requests"
            )
