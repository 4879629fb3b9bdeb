"""Admission: which waiting requests start this step, and with how many tokens.

Waiting requests are tried in the policy's order while a running slot, token budget and pages
last. A request starts on its longest cached prefix; its first chunk is scheduled beside the
running requests' work. A request whose grammar is still compiling is skipped (the ones behind
it go ahead); one whose next prompt page is being prefilled by a running request waits for that
page to land in the cache (in-batch prefix caching: the leader caches each chunk as it
completes, so the wait is a step or a few).

NOTE: admission stops at the first request that cannot get pages (no head-of-line skipping):
letting smaller requests pass would starve a large one under load.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

from radixlm.config import SchedulerConfig
from radixlm.radix import RadixCache
from radixlm.runtime.batch import SampleError, ScheduledItem
from radixlm.runtime.grammar.errors import GrammarTimeoutError
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.scheduler.pages import PageManager
from radixlm.runtime.scheduler.policy import SchedulePolicy

logger = logging.getLogger(__name__)


def take_compiled_grammar(req: Request) -> SampleError | None:
    """If ``req``'s grammar future is done: on success give it its matcher (``req.grammar``)
    and return None; on failure (invalid, timed out, cancelled) return why, with the code
    ``grammar_timeout`` or ``grammar_error``. A pending future changes nothing (None)."""
    fut = req.grammar_future
    if fut is None or req.grammar is not None or not fut.done():
        return None
    try:
        req.grammar = fut.result().new_matcher()
    except Exception as exc:  # noqa: BLE001 - GrammarError, CancelledError: this request only
        code = "grammar_timeout" if isinstance(exc, GrammarTimeoutError) else "grammar_error"
        return SampleError(str(exc) or f"grammar compilation failed: {type(exc).__name__}", code)
    return None


class Outcome(enum.Enum):
    ADMITTED = "admitted"
    SKIP = "skip"  # it waits; the ones behind it may go
    STOP = "stop"  # admission ends here (no pages)
    TOO_BIG = "too_big"  # it cannot fit even alone: the caller fails it


@dataclass
class Admitted:
    outcome: Outcome
    num_tokens: int = 0
    first: bool = False  # the request's first admission (not a re-admission after retraction)


class Admission:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: RadixCache,
        pages: PageManager,
        policy: SchedulePolicy,
    ) -> None:
        self.config = config
        self.cache = cache
        self.pages = pages
        self.policy = policy

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        """The policy's order; arrival order if the policy fails (never stops admission)."""
        try:
            return self.policy.order(waiting)
        except Exception:  # noqa: BLE001 - a policy failure must not stop admission
            logger.exception("scheduling policy failed; admitting in arrival order")
            return list(waiting)

    def try_admit(
        self,
        req: Request,
        running: list[Request],
        items: list[ScheduledItem],
        budget: int,
        inflight: set[int],
        finishing: bool = False,
    ) -> Admitted:
        """Admit `req` for at most `budget` tokens: on success it holds its pages, is RUNNING,
        appended to `running`, and its item to `items`. With `finishing`, only if what its
        prefix hit leaves fits in one chunk of `budget` (its prompt is computed this step)."""
        cfg = self.config
        if req.grammar_pending:
            return Admitted(Outcome.SKIP)  # its grammar is compiling
        if self.shares_inflight_prefix(req, inflight):
            return Admitted(Outcome.SKIP)  # wait for the leader's prefill, then hit it
        if not self.pages.tier_ready(req):
            return Admitted(Outcome.SKIP)  # its pages are being read from the second tier
        hit = self.pages.adopt_prefix(req, reserve=len(running))
        remaining = req.num_uncomputed
        if finishing and remaining > min(budget, cfg.chunked_prefill_size or math.inf):
            self.pages.release(req)  # its loaded or matched pages stay cached in the tree
            return Admitted(Outcome.SKIP)
        if cfg.chunked_prefill_size is None:
            # No chunking: the whole prompt, past the budget only when it runs alone.
            if remaining > budget and items:
                self.pages.release(req)
                return Admitted(Outcome.STOP)
            n = remaining
        else:
            n = int(min(remaining, cfg.chunked_prefill_size or math.inf, budget))
        if not self.pages.alloc_with_reserve(req, req.num_computed_tokens + n, len(running)):
            self.pages.release(req)
            if not running and not items:
                return Admitted(Outcome.TOO_BIG)
            return Admitted(Outcome.STOP)
        first = not req.admitted_once
        if first:
            req.admitted_once = True
            req.num_cached_tokens = hit
        req.status = RequestStatus.RUNNING
        running.append(req)
        items.append(ScheduledItem(req, n))
        if self.cache.enabled:
            inflight.update(req.prompt_page_hashes(self.pages.page_size))
        return Admitted(Outcome.ADMITTED, n, first)

    def inflight_prefixes(self, running: list[Request]) -> set[int]:
        """Page-prefix hashes of prompts still being prefilled (in-batch prefix sharing)."""
        keys: set[int] = set()
        if self.cache.enabled:
            for r in running:
                if r.num_computed_tokens < r.num_prompt_tokens:
                    keys.update(r.prompt_page_hashes(self.pages.page_size))
        return keys

    def shares_inflight_prefix(self, req: Request, inflight: set[int]) -> bool:
        """True when the page after the cache hit is being computed by a running prefill:
        admitting now would compute it twice."""
        if not inflight or req.num_retractions:
            return False
        ps = self.pages.page_size
        hit_pages = self.cache.peek_prefix_len(req.token_ids[: req.num_tokens - 1], req.namespace)
        hit_pages //= ps
        hashes = req.prompt_page_hashes(ps)
        return hit_pages < len(hashes) - 1 and hashes[hit_pages] in inflight
