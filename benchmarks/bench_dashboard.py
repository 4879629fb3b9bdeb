"""Does an open `/dashboard` slow the step loop? Step time with and without a viewer.

    .venv/bin/python benchmarks/bench_dashboard.py [--rounds 2] [--concurrency 8]
        [--max-new-tokens 48] [--waves 4] [--viewer-hz 1 10] [--threads 2]
        [--out benchmarks/results/dashboard.json]

Part 1: one in-process `Engine` (default model) runs the same shared-system-prompt workload
(`waves` x `concurrency` chat requests, EOS ignored) several times, alternating the conditions:
no viewer, and a viewer that does what the server's `DashboardHub` does for open pages at
`viewer-hz` samples per second (`Engine.snapshot` under the engine lock, then the hub's
serialization outside it, in another thread). Reported per run: mean step time (wall time /
model forwards), output tok/s, and the snapshot's lock-held time (`take_snapshot` alone, timed
inside the lock by the viewer). The runs alternate (A B A B ...) so that a neighbour's load on a
shared machine hits both conditions alike.

Part 2: the summary's cost on big synthetic trees (no model): `summarize` (what the engine runs
under its lock, O(summary)) vs `summarize_full` (a walk over the whole tree) for 1k..100k nodes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

SYSTEM = (
    "You are the reservations assistant of a large hotel group. Answer in two sentences, quote "
    "prices in euros, mention the check-in time (15:00) and the check-out time (11:00), and "
    "never invent room types: the group offers single, double, twin and family rooms, suites on "
    "the top floors of its city hotels, and apartments with kitchens at its beach resorts. "
)


def run_workload(engine: Any, args: argparse.Namespace, wave_offset: int) -> dict[str, float]:
    from radixlm import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0, ignore_eos=True)
    before = engine.stats()
    t0 = time.perf_counter()
    for w in range(args.waves):
        prompts = [
            engine.apply_chat_template(
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Guest {wave_offset}.{w}.{i}: a room for two?"},
                ]
            )
            for i in range(args.concurrency)
        ]
        engine.generate(prompts, [params] * len(prompts))
    wall = time.perf_counter() - t0
    after = engine.stats()
    forwards = after.num_forwards - before.num_forwards
    tokens = after.generated_tokens - before.generated_tokens
    return {
        "wall_s": wall,
        "steps": forwards,
        "step_ms": 1000 * wall / max(forwards, 1),
        "output_tok_per_s": tokens / wall,
        "hit_rate": (after.cache_hit_tokens - before.cache_hit_tokens)
        / max(after.cache_queried_tokens - before.cache_queried_tokens, 1),
    }


class Viewer:
    """What the server does for open dashboards, at `hz` samples per second."""

    def __init__(self, engine: Any, hz: float) -> None:
        from radixlm.runtime.observe import take_snapshot
        from radixlm.server.dashboard import DashboardHub
        from radixlm.server.metrics import ServerMetrics

        self.engine, self.hz = engine, hz
        self.hub = DashboardHub(engine, ServerMetrics(engine.stats))
        self._take = take_snapshot
        self.held_ms: list[float] = []
        self.serialize_ms: list[float] = []
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.wait(1.0 / self.hz):
            with engine._lock:  # exactly Engine.snapshot, timed inside the lock
                t0 = time.perf_counter()
                snap = self._take(engine.scheduler, self.hub.options)
                self.held_ms.append(1000 * (time.perf_counter() - t0))
            t1 = time.perf_counter()
            self.bytes = len(self.hub._serialize(snap, include_history=False))
            self.serialize_ms.append(1000 * (time.perf_counter() - t1))

    def __enter__(self) -> Viewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def part1(args: argparse.Namespace) -> dict[str, Any]:
    from radixlm import Engine

    engine = Engine(args.model, dtype=args.dtype, num_threads=args.threads)
    try:
        run_workload(engine, args, wave_offset=-1)  # warm-up (and the shared prefix cached)
        conditions = [0.0, *args.viewer_hz]
        runs: dict[str, list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for hz in conditions:
                name = "no viewer" if hz == 0 else f"viewer {hz:g} Hz"
                if hz == 0:
                    res = run_workload(engine, args, wave_offset=r * 10 + len(runs))
                else:
                    with Viewer(engine, hz) as v:
                        res = run_workload(engine, args, wave_offset=r * 10 + len(runs))
                    res["snapshots"] = len(v.held_ms)
                    res["lock_held_ms_mean"] = statistics.fmean(v.held_ms or [0.0])
                    res["lock_held_ms_max"] = max(v.held_ms or [0.0])
                    res["serialize_ms_mean"] = statistics.fmean(v.serialize_ms or [0.0])
                    res["payload_bytes"] = v.bytes
                runs.setdefault(name, []).append(res)
                line = ", ".join(f"{k} {v:.3f}" for k, v in res.items())
                print(f"round {r} {name:>14}: {line}", flush=True)
        summary = {
            name: {
                "step_ms_median": statistics.median(x["step_ms"] for x in rs),
                "output_tok_per_s_median": statistics.median(x["output_tok_per_s"] for x in rs),
                "steps_per_run": rs[0]["steps"],
            }
            for name, rs in runs.items()
        }
        return {"runs": runs, "summary": summary}
    finally:
        engine.shutdown()


def part2() -> list[dict[str, Any]]:
    from radixlm.radix import BlockPool, RadixCache
    from radixlm.radix.summary import summarize, summarize_full

    out = []
    for num in (1_000, 10_000, 100_000):
        # A shared 4-page head, then `num` distinct 2-page branches under it (page size 1).
        pool = BlockPool(2 * num + 8, 1)
        cache = RadixCache(pool)
        for k in range(num):
            seq = [1, 2, 3, 4, 10 + k, 7]
            m = cache.match_prefix(seq)
            cache.lock(m.node)
            pages = m.pages + pool.alloc(len(seq) - len(m.pages))
            pool.decref(cache.insert_and_adopt(seq, pages))
        t0 = time.perf_counter()
        for _ in range(20):
            s = summarize(cache)
        inc = (time.perf_counter() - t0) / 20
        t0 = time.perf_counter()
        full = summarize_full(cache)
        walk = time.perf_counter() - t0
        assert s == full
        row = {"nodes": cache.num_nodes, "summary_nodes": len(s.nodes)}
        row |= {"summarize_ms": 1000 * inc, "full_walk_ms": 1000 * walk}
        print(row, flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--viewer-hz", type=float, nargs="+", default=[1.0, 10.0])
    p.add_argument("--skip-engine", action="store_true", help="only part 2 (no model)")
    p.add_argument("--out", default="benchmarks/results/dashboard.json")
    args = p.parse_args()
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "args": vars(args),
        "summary_cost": part2(),
    }
    if not args.skip_engine:
        result["step_time"] = part1(args)
        for name, s in result["step_time"]["summary"].items():
            print(
                f"{name:>14}: step {s['step_ms_median']:.1f} ms (median of runs), "
                f"{s['output_tok_per_s_median']:.1f} output tok/s, {s['steps_per_run']} steps/run"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
