"""Where a returning turn's TTFT goes on `bench_hicache.py`'s trace, from the engine's own steps.

    .venv/bin/python benchmarks/hicache_breakdown.py [--tier/--no-tier] [--conversations 8]
        [--turns 2] [... bench_hicache.py's trace flags] [--out FILE.json]

Runs the trace in process (one `Engine`, `--concurrency` client threads, greedy, the pool at
`--pool-fraction` of the working set) and logs every engine step (start, end, each request's
tokens in it). Per returning turn (turn >= 1) it reports, besides the TTFT:

- tokens: prompt, cached (pool + tier), computed (its own prefill);
- time: in the queue (arrival -> the step that first schedules it: waiting for a slot, the
  budget, or its tier read) vs in steps (that step's start -> its first token);
- the steps' tokens while it was in them: its own vs the other requests' (prefill chunks and
  decodes), and the tokens of the step it arrived during;

so the share of a returning turn's TTFT spent behind other requests' prefills is read off token
counts, which a loaded machine does not change (times are then only shares).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hicache import (  # noqa: E402
    PAGE,
    Turn,
    add_trace_args,
    make_trace,
    pool_pages,
    working_set_tokens,
)


@dataclass
class Step:
    start: float
    end: float = 0.0
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens in this step


@dataclass
class TurnBreakdown:
    conversation: int
    index: int
    ttft: float
    queue_s: float
    in_steps_s: float
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    own_step_tokens: int
    other_step_tokens: int  # others' tokens in the steps from its first schedule to its token
    other_prefill_tokens: int  # ... of them, prefill chunks (> 1 token)
    arrival_step_tokens: int  # tokens of the step running when it arrived


class StepLog:
    """Hooks the scheduler: a step starts at `schedule()`, ends at `update()`."""

    def __init__(self, scheduler: object) -> None:
        self.steps: list[Step] = []
        self.arrival: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        sched_fn, update_fn = scheduler.schedule, scheduler.update  # type: ignore[attr-defined]

        def schedule():  # type: ignore[no-untyped-def]
            t = time.monotonic()
            batch = sched_fn()
            if batch.items:
                step = Step(t, tokens={i.req.request_id: i.num_tokens for i in batch.items})
                self.steps.append(step)
                for i in batch.items:
                    self.arrival.setdefault(i.req.request_id, i.req.arrival_time)
            return batch

        def update(batch, out):  # type: ignore[no-untyped-def]
            result = update_fn(batch, out)
            if batch.items and self.steps:
                self.steps[-1].end = time.monotonic()
                for i in batch.items:
                    r = i.req
                    if r.first_token_time is not None:
                        self.first_token.setdefault(r.request_id, r.first_token_time)
            return result

        scheduler.schedule = schedule  # type: ignore[attr-defined]
        scheduler.update = update  # type: ignore[attr-defined]

    def breakdown(self, rid: str, turn: Turn, prompt: int, cached: int) -> TurnBreakdown:
        arrival, first = self.arrival[rid], self.first_token[rid]
        mine = [s for s in self.steps if rid in s.tokens and s.start <= first]
        start = mine[0].start
        during = [s for s in self.steps if start <= s.start <= first]
        at_arrival = [s for s in self.steps if s.start <= arrival < s.end]
        others = [(k, n) for s in during for k, n in s.tokens.items() if k != rid]
        return TurnBreakdown(
            conversation=turn.conversation,
            index=turn.index,
            ttft=first - arrival,
            queue_s=start - arrival,
            in_steps_s=first - start,
            prompt_tokens=prompt,
            cached_tokens=cached,
            computed_tokens=prompt - cached,
            own_step_tokens=sum(s.tokens.get(rid, 0) for s in during),
            other_step_tokens=sum(n for _, n in others),
            other_prefill_tokens=sum(n for _, n in others if n > 1),
            arrival_step_tokens=sum(sum(s.tokens.values()) for s in at_arrival),
        )


def run(args: argparse.Namespace) -> dict[str, object]:
    from radixlm import Engine, SamplingParams

    trace = make_trace(args, random.Random(args.seed))
    ws = working_set_tokens(trace)
    num_pages = pool_pages(args, trace)
    store = Path(tempfile.mkdtemp(prefix="hicache-breakdown-"))
    tier = {"hicache_storage_dir": str(store)} if args.tier else {}
    params = SamplingParams(max_new_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    rows: list[TurnBreakdown] = []
    first_ttft: list[float] = []
    try:
        with Engine(
            dtype="bfloat16", num_threads=args.threads, num_pages=num_pages, page_size=PAGE,
            schedule_policy=args.schedule_policy, max_prefill_tokens=args.max_prefill_tokens,
            **tier,
        ) as eng:  # fmt: skip
            log = StepLog(eng.parts.scheduler)
            queue = list(trace)
            lock = threading.Lock()
            done = {(t.conversation, t.index): threading.Event() for t in trace}

            def client() -> None:
                while True:
                    with lock:
                        if not queue:
                            return
                        turn = queue.pop(0)
                    if turn.index:
                        done[(turn.conversation, turn.index - 1)].wait()
                    t = time.monotonic()
                    res = eng.generate(turn.prompt, params)
                    if not turn.index:
                        first_ttft.append(log.first_token[res.request_id] - t)
                    else:
                        rows.append(
                            log.breakdown(
                                res.request_id, turn, len(turn.prompt), res.usage.cached_tokens
                            )
                        )
                    done[(turn.conversation, turn.index)].set()

            t0 = time.monotonic()
            threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.monotonic() - t0
            stats = eng.stats()
    finally:
        shutil.rmtree(store, ignore_errors=True)

    def med(name: str) -> float:
        return statistics.median(getattr(r, name) for r in rows)

    summary = {
        name: med(name)
        for name in (
            "ttft", "queue_s", "in_steps_s", "prompt_tokens", "cached_tokens",
            "computed_tokens", "own_step_tokens", "other_step_tokens", "other_prefill_tokens",
            "arrival_step_tokens",
        )
    }  # fmt: skip
    return {
        "tier": args.tier,
        "schedule_policy": args.schedule_policy,
        "max_prefill_tokens": args.max_prefill_tokens,
        "num_pages": num_pages,
        "working_set_tokens": ws,
        "hicache_hit_tokens": getattr(stats, "hicache_hit_tokens", 0),
        "wall_s": wall,
        "output_tok_per_s": len(trace) * args.output_tokens / wall,
        "first_turn_ttft_p50": statistics.median(first_ttft),
        "returning_medians": summary,
        "returning": [asdict(r) for r in rows],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", action=argparse.BooleanOptionalAction, default=True)
    add_trace_args(p, conversations=8, turns=2)
    p.add_argument("--schedule-policy", default="lpm")
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    res = run(args)
    print(json.dumps({k: v for k, v in res.items() if k != "returning"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
