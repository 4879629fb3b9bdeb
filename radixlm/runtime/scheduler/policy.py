"""Admission order of waiting requests, by name: `fcfs` and `lpm` (longest prefix match: the
pool's match plus, with a second KV tier, the tier's consecutive pages after it, which admission
loads instead of computing).

A policy only orders; the scheduler admits in that order until budget or memory runs out.
Retracted requests sit at the front of the queue and `fcfs` keeps them there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from radixlm.config import SchedulerConfig
from radixlm.radix import HiCache, RadixCache
from radixlm.runtime.request import Request

# Above this many waiting requests, LPM's per-step prefix matching costs more than it saves.
LPM_MAX_QUEUE = 128


class SchedulePolicy(Protocol):
    def order(self, waiting: Iterable[Request]) -> list[Request]: ...


_POLICIES: dict[str, Callable[..., SchedulePolicy]] = {}


def register_policy(name: str):
    def wrap(cls):
        _POLICIES[name] = cls
        return cls

    return wrap


def create_policy(
    name: str,
    config: SchedulerConfig,
    cache: RadixCache,
    clock: Callable[[], float],
    hicache: HiCache | None = None,
) -> SchedulePolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown schedule_policy {name!r}; available: {sorted(_POLICIES)}")
    return _POLICIES[name](config, cache, clock, hicache)


@register_policy("fcfs")
class FCFS:
    def __init__(self, config: SchedulerConfig, cache: RadixCache, clock, hicache=None) -> None:
        pass

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        return list(waiting)


@register_policy("lpm")
class LongestPrefixMatch:
    """Most cached prefix first (pool hit + tier hit), plus an aging term: each second waited
    counts as `aging_tokens_per_second` matched tokens, so a request with no match cannot
    starve."""

    def __init__(
        self, config: SchedulerConfig, cache: RadixCache, clock, hicache: HiCache | None = None
    ) -> None:
        self.aging = config.aging_tokens_per_second
        self.cache = cache
        self.hicache = hicache
        self.clock = clock

    def prefix_len(self, req: Request) -> int:
        """Tokens of `req` admission would not compute: the pool's match, then the tier's."""
        tokens = req.token_ids[: req.num_tokens - 1]
        hit = self.cache.peek_prefix_len(tokens, req.namespace)
        if self.hicache is not None:
            hit += self.hicache.peek_len(tokens, req.namespace, hit)
        return hit

    def order(self, waiting: Iterable[Request]) -> list[Request]:
        reqs = list(waiting)
        if len(reqs) > LPM_MAX_QUEUE or not self.cache.enabled:
            return reqs
        now = self.clock()

        def score(item: tuple[int, Request]) -> tuple[float, int]:
            pos, req = item
            hit = self.prefix_len(req)
            # Retracted requests keep their place at the front; ties keep arrival order.
            bonus = float("inf") if req.num_retractions else 0.0
            return (-(hit + self.aging * (now - req.arrival_time) + bonus), pos)

        return [r for _, r in sorted(enumerate(reqs), key=score)]
