"""Admission and retraction alone: outcomes (admitted, skip, stop, too big), the cache hit
reported once, in-batch prefix waits, and the retraction victim."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from radixlm.config import SchedulerConfig
from radixlm.radix import BlockPool, RadixCache
from radixlm.runtime.batch import ScheduledItem
from radixlm.runtime.request import Request, RequestStatus
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.admission import Admission, Outcome
from radixlm.runtime.scheduler.pages import PageManager
from radixlm.runtime.scheduler.policy import create_policy
from radixlm.runtime.scheduler.retraction import Retraction


def make(num_pages: int = 8, page_size: int = 4, **cfg) -> Admission:
    pool = BlockPool(num_pages, page_size)
    cache = RadixCache(pool)
    config = SchedulerConfig(**cfg)
    policy = create_policy(config.schedule_policy, config, cache, lambda: 0.0)
    return Admission(config, cache, PageManager(pool, cache), policy)


def req(rid: str, prompt: list[int], arrival: float = 0.0) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=4), arrival_time=arrival)


def test_admitted_request_runs_on_its_cache_hit_with_its_first_chunk():
    adm = make(chunked_prefill_size=4)
    first = req("a", list(range(12)))
    running: list[Request] = []
    items: list[ScheduledItem] = []
    got = adm.try_admit(first, running, items, budget=64, inflight=set())
    assert got.outcome is Outcome.ADMITTED and got.num_tokens == 4 and got.first
    assert running == [first] and first.status is RequestStatus.RUNNING
    first.num_computed_tokens = 8
    adm.pages.try_grow(first, 8)
    adm.pages.cache_computed(first)
    again = req("b", list(range(12)))
    got = adm.try_admit(again, running, items, budget=64, inflight=set())
    assert got.outcome is Outcome.ADMITTED and again.num_cached_tokens == 8
    assert again.num_computed_tokens == 8 and items[-1].num_tokens == 4


def test_a_compiling_grammar_is_skipped_and_no_pages_stop_admission():
    adm = make(num_pages=4)
    compiling = req("g", [1, 2, 3])
    compiling.grammar_future = Future()
    assert adm.try_admit(compiling, [], [], 64, set()).outcome is Outcome.SKIP
    assert compiling.pages == []
    big = req("big", list(range(40)))  # 10 pages: never fits the pool
    assert adm.try_admit(big, [], [], 64, set()).outcome is Outcome.TOO_BIG
    other = req("o", [5, 6])
    assert adm.try_admit(big, [other], [], 64, set()).outcome is Outcome.STOP
    assert big.pages == [] and adm.pages.pool.num_held == 0


def test_a_follower_waits_for_the_leaders_prefill_of_its_next_page():
    adm = make(num_pages=16, chunked_prefill_size=4)
    leader, follower = req("l", list(range(16))), req("f", list(range(16)))
    running: list[Request] = []
    inflight: set[int] = set()
    assert adm.try_admit(leader, running, [], 64, inflight).outcome is Outcome.ADMITTED
    assert adm.shares_inflight_prefix(follower, inflight)
    assert adm.try_admit(follower, running, [], 64, inflight).outcome is Outcome.SKIP
    assert adm.inflight_prefixes(running) == inflight


def test_retraction_takes_the_least_progress_and_queues_it_first():
    adm = make(num_pages=16)
    a, b = req("a", list(range(9)), arrival=0.0), req("b", list(range(20, 29)), arrival=1.0)
    running: list[Request] = []
    items: list[ScheduledItem] = []
    for r in (a, b):
        adm.try_admit(r, running, items, 64, set())
    a.token_ids.append(7)  # a has one output token: b has made less progress
    retraction = Retraction(adm.pages)
    victim = retraction.victim(running)
    assert victim is b
    b.num_computed_tokens = 8
    waiting: deque[Request] = deque([req("w", [1])])
    retraction.retract(b, running, waiting, items)
    assert running == [a] and waiting[0] is b and [i.req for i in items] == [a]
    assert b.status is RequestStatus.WAITING and b.pages == [] and b.num_retractions == 1
    assert adm.pages.pool.num_cached == 2  # its computed full pages went to the cache
    adm.pages.check_integrity(running, list(waiting))


class _NullIO:
    def read_pages(self, pages: list[int]) -> list[bytes]:
        return [b"page" for _ in pages]

    def write_pages(self, pages: list[int], payloads: list[bytes]) -> None:
        pass


def test_lpm_counts_the_second_tiers_pages_after_the_pool_match():
    from radixlm.radix import HiCache, HostTierStore
    from radixlm.radix.tier import page_keys

    pool = BlockPool(8, 4)
    cache = RadixCache(pool)
    hicache = HiCache(cache, HostTierStore(1 << 20), _NullIO())
    config = SchedulerConfig(schedule_policy="lpm")
    pool_hit = req("pool", list(range(12)))  # one page in the pool
    tier_hit = req("tier", list(range(100, 113)))  # the pool holds nothing; the tier 3 pages
    first = req("none", list(range(200, 212)))  # first in line, nothing cached
    page = pool.alloc(1)
    cache.insert_and_adopt(list(range(4)), page, None)
    pool.decref(page)
    for key in page_keys(tier_hit.token_ids[:12], 4):
        hicache.store.put(key, b"page")
    waiting = [first, pool_hit, tier_hit]
    lpm = create_policy("lpm", config, cache, lambda: 0.0, hicache)
    assert lpm.order(waiting) == [tier_hit, pool_hit, first]
    assert lpm.prefix_len(tier_hit) == 12 and lpm.prefix_len(pool_hit) == 4
    # the tier's pages count only right after the pool's match: a gap ends the hit
    hicache.store.drop(next(iter(page_keys(tier_hit.token_ids, 4))))
    assert lpm.prefix_len(tier_hit) == 0
    no_tier = create_policy("lpm", config, cache, lambda: 0.0)
    assert no_tier.order(waiting) == [pool_hit, first, tier_hit]
