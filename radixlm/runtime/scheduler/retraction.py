"""Retraction (preemption) under memory pressure: the running request with the least progress
gives its pages back and waits at the front of the queue; its computed full pages go to the
radix cache first, so its recomputation is mostly prefix hits."""

from __future__ import annotations

import logging
from collections import deque

from radixlm.runtime.batch import ScheduledItem
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.scheduler.pages import PageManager

logger = logging.getLogger(__name__)


class Retraction:
    def __init__(self, pages: PageManager) -> None:
        self.pages = pages
        self.num_retractions = 0

    @staticmethod
    def victim(running: list[Request]) -> Request:
        """The least output so far; the latest arrival among equals."""
        return min(running, key=lambda r: (r.num_output_tokens, -r.arrival_time))

    def retract(
        self,
        req: Request,
        running: list[Request],
        waiting: deque[Request],
        items: list[ScheduledItem],
    ) -> None:
        """Preempt `req`: drop its item from this step, cache its computed full pages, free the
        rest, and queue it first."""
        items[:] = [i for i in items if i.req is not req]
        running.remove(req)
        self.pages.cache_computed(req)
        self.pages.release(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        waiting.appendleft(req)
        logger.debug("retracted %s (%d tokens)", req.request_id, req.num_tokens)
