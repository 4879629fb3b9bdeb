"""TierLoads alone: a background read per waiting request, the wake when it ends, the bound on
reads held at once (then a synchronous read rather than a wait nobody ends), pruning."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from radixlm.radix import BlockPool, HiCache, HostTierStore, RadixCache
from radixlm.radix.tier import page_keys
from radixlm.runtime.request import Request
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.tier_loads import MAX_READS, TierLoads

PS = 4


class NullIO:
    def read_pages(self, pages: Sequence[int]) -> list[bytes]:
        return [b"" for _ in pages]

    def write_pages(self, pages: Sequence[int], payloads: Sequence[bytes]) -> None:
        pass


def setup(n_prompts: int) -> tuple[TierLoads, list[Request], threading.Event, list[int]]:
    pool = BlockPool(16, PS)
    hicache = HiCache(RadixCache(pool), HostTierStore(1 << 20), NullIO())
    reqs = []
    for i in range(n_prompts):
        tokens = [100 * i + j for j in range(9)]
        for key in page_keys(tokens, PS):
            hicache.store.put(key, b"page")
        reqs.append(Request(f"r{i}", tokens, SamplingParams(max_new_tokens=1)))
    gate = threading.Event()
    real = hicache.read

    def gated(*args: object) -> dict[bytes, bytes]:
        gate.wait(10)
        return real(*args)  # type: ignore[arg-type]

    hicache.read = gated  # type: ignore[method-assign]
    loads = TierLoads(hicache)
    woken: list[int] = []
    loads.on_done = lambda: woken.append(1)
    return loads, reqs, gate, woken


def ask(loads: TierLoads, req: Request) -> bool:
    return loads.ready(req, req.token_ids[:8], None, 0)


def test_a_read_runs_in_the_background_and_wakes_the_loop() -> None:
    loads, (req,), gate, woken = setup(1)
    assert not ask(loads, req) and loads.pending(req)
    gate.set()
    loads._fetches[id(req)][1].result(timeout=10)
    deadline = time.monotonic() + 10
    while not woken and time.monotonic() < deadline:  # callbacks run just after the result
        time.sleep(0.001)
    assert woken == [1] and not loads.pending(req) and ask(loads, req)
    got = loads.take(req)
    assert got is not None and len(got) == 2  # the 8 usable tokens: two pages
    assert loads.take(req) is None
    loads.close()


def test_reads_held_at_once_are_bounded() -> None:
    loads, reqs, gate, _ = setup(MAX_READS + 1)
    for req in reqs[:MAX_READS]:
        assert not ask(loads, req)
    extra = reqs[-1]
    assert not ask(loads, extra) and loads.pending(extra)  # waits for a slot
    assert id(extra) not in loads._fetches
    gate.set()
    for req in reqs[:MAX_READS]:
        loads._fetches[id(req)][1].result(timeout=10)
    assert not loads.pending(extra)
    assert ask(loads, extra)  # none in flight: admitted now, `load` reads synchronously
    loads.retain(reqs[:1])  # the others left the queue
    assert list(loads._fetches) == [id(reqs[0])]
    loads.close()
