"""Multi-turn conversations that outlive the KV pool: radixlm with its second KV tier
(`--hicache-storage-dir`, page files; `radixlm-tier` write-back, `radixlm-tier-wt`
write-through), without it (recomputation), and optionally vLLM's CPU
build with prefix caching, on one generated trace; then a warm restart.

    .venv/bin/python benchmarks/bench_hicache.py
        [--systems radixlm-tier,radixlm-tier-wt,radixlm,vllm]
        [--conversations 48] [--turns 4] [--system-prompts 4] [--system-tokens 1024]
        [--turn-tokens 300] [--output-tokens 64] [--concurrency 4] [--pool-fraction 0.1]
        [--hicache-size 4] [--threads 2] [--max-prefill-tokens 256] [--no-returning-case]
        [--returning-tokens 2048] [--returning-new-tokens 32] [--returning-reps 3]
        [--out benchmarks/results/hicache.json]

The trace has the shape of Mooncake's conversation traces: `--conversations` users over a few
shared system prompts; each turn sends the whole conversation so far (system prompt, earlier
user turns and replies) plus a new user message of about `--turn-tokens` tokens; turn t of every
user comes after turn t - 1 of all users (in a shuffled order), so a returning user finds that
the others have pushed their conversation out of the pool. The KV pool is sized to
`--pool-fraction` of the trace's working set (radixlm `--num-pages`; vLLM
`--num-gpu-blocks-override`, block size 32: its CPU build refuses 16). Prompts are token ids
(the same for every system); replies in the trace are synthetic (greedy outputs are not fed
back) so every system sees the same prompts. `--concurrency` clients send in trace order; a
user's next turn waits for the previous one.

`--codec-only` measures only the tier's data path, no server: the page codec (pool pages <->
bytes; a load after the first, whose staging buffer is allocated) and the file store's write /
read+verify bandwidth (read as `HiCache.fetch` reads: into a reused buffer) in GB/s for a KV layout
(`--layout smollm2` or `llama3-8b`, `--device cpu` or `cuda`: the host-memory tier under a CUDA
pool) over `--codec-tokens` tokens (a returning conversation).

`--returning-case` (on by default; `--no-returning-case` skips it) is the issue's 10x target at
concurrency 1: one radixlm server with the file tier and a pool just larger than one
conversation; per repetition a `--returning-tokens` (2048) conversation is computed, a filler
prompt pushes it out of the pool (to the tier), the user returns with a `--returning-new-tokens`
(32) message and its TTFT is taken (history loaded from the tier); then `/flush_cache` (both
tiers) and the same prompt again: the TTFT of recomputing it. Tier and recomputation alternate
in the same server, `--returning-reps` times; medians and their ratio are reported.

radixlm runs with `--max-prefill-tokens 256` by default here (`0`: its engine default): a step's
prefill tokens are bounded and go to the shortest remaining prompt first, so a returning turn
whose history came from the tier is not computed beside the others' prefill chunks
(`benchmarks/hicache_breakdown.py` shows where a returning turn's TTFT goes, step by step), and
a step is short, so a request whose pages just loaded waits less for the step in flight to end
(256 vs 512, alternated on the trace: returning TTFT p50 0.47 / 0.61 vs 0.73 / 0.76 s, output
tok/s 93.4 vs 94.0).

Reported per system: TTFT p50 / p99 of returning turns (turn >= 1) and of first turns, output
tok/s over the whole trace, and the share of returning-turn prompt tokens reported cached. For
the tier systems a warm restart follows: the server is stopped and started again over the same
storage directory, and one new conversation on a known system prompt reports its cached tokens
and TTFT. Prints the CPU (flags) and the load average before and after; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from bench_peers import (  # noqa: E402
    SERVED_NAME,
    ServerSpec,
    _loadavg,
    cpu_description,
    ensure_vllm_venv,
    radixlm_spec,
    running_server,
    vllm_spec,
)
from serving import RequestResult, _free_port, percentile, stream_request  # noqa: E402

SYSTEMS = ("radixlm-tier", "radixlm-tier-wt", "radixlm", "vllm")
PAGE = 16  # tokens per KV page (radixlm)
VLLM_CPU_BLOCK = 32  # vLLM's CPU attention takes multiples of 32 ("No common block size for 16")
TOKEN_RANGE = (1000, 40000)  # plain word-piece ids of the default model's vocabulary


@dataclass(frozen=True)
class Turn:
    conversation: int
    index: int  # 0: the user's first turn
    prompt: list[int]


@dataclass
class SystemResult:
    system: str
    returning_ttft_p50: float
    returning_ttft_p99: float
    first_ttft_p50: float
    first_ttft_p99: float
    output_tok_per_s: float
    returning_cached_share: float
    completed: int
    failed: int
    wall_s: float
    tier: dict[str, Any] | None = None  # radixlm's engine_stats.hicache_* after the trace
    restart_cached_tokens: int | None = None
    restart_prompt_tokens: int | None = None
    restart_ttft: float | None = None


def make_trace(args: argparse.Namespace, rng: random.Random) -> list[Turn]:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    def about(n: int) -> int:
        return max(1, int(n * rng.uniform(0.7, 1.3)))

    systems = [tokens(args.system_tokens) for _ in range(args.system_prompts)]
    history = [list(systems[c % len(systems)]) for c in range(args.conversations)]
    trace: list[Turn] = []
    for t in range(args.turns):
        order = list(range(args.conversations))
        rng.shuffle(order)
        for c in order:
            history[c] += tokens(about(args.turn_tokens))  # the user's message
            trace.append(Turn(c, t, list(history[c])))
            history[c] += tokens(args.output_tokens)  # a synthetic reply
    return trace


def working_set_tokens(trace: list[Turn]) -> int:
    """Distinct prefix tokens the trace touches: each conversation's last prompt, the shared
    system prompts once."""
    last: dict[int, int] = {}
    for turn in trace:
        last[turn.conversation] = len(turn.prompt)
    return sum(last.values())


def pool_pages(args: argparse.Namespace, trace: list[Turn]) -> int:
    """The pool: `--pool-fraction` of the working set, and at least the concurrent requests."""
    longest = max(len(t.prompt) for t in trace) + args.output_tokens
    return max(
        math.ceil(args.pool_fraction * working_set_tokens(trace) / PAGE),
        args.concurrency * math.ceil(longest / PAGE),
    )


async def run_trace(url: str, trace: list[Turn], args: argparse.Namespace) -> tuple[
    list[tuple[Turn, RequestResult]], float
]:  # fmt: skip
    queue: asyncio.Queue[Turn] = asyncio.Queue()
    for turn in trace:
        queue.put_nowait(turn)
    done: dict[tuple[int, int], asyncio.Event] = {(t.conversation, t.index): asyncio.Event()
                                                  for t in trace}  # fmt: skip
    results: list[tuple[Turn, RequestResult]] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            turn = queue.get_nowait()
            if turn.index:
                await done[(turn.conversation, turn.index - 1)].wait()
            res = await stream_request(http, "/v1/completions", _body(turn.prompt, args))
            results.append((turn, res))
            done[(turn.conversation, turn.index)].set()

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
    return results, time.perf_counter() - t0


def _body(prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": args.output_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


def summarize(system: str, results: list[tuple[Turn, RequestResult]], wall: float) -> SystemResult:
    ok = [(t, r) for t, r in results if r.ok]
    ret = [r for t, r in ok if t.index > 0]
    first = [r for t, r in ok if t.index == 0]
    prompt_ret = sum(r.prompt_tokens for r in ret)
    return SystemResult(
        system=system,
        returning_ttft_p50=percentile([r.ttft for r in ret], 50),
        returning_ttft_p99=percentile([r.ttft for r in ret], 99),
        first_ttft_p50=percentile([r.ttft for r in first], 50),
        first_ttft_p99=percentile([r.ttft for r in first], 99),
        output_tok_per_s=sum(r.output_tokens for _, r in ok) / wall if wall else 0.0,
        returning_cached_share=sum(r.cached_tokens for r in ret) / prompt_ret if prompt_ret else 0,
        completed=len(ok),
        failed=len(results) - len(ok),
        wall_s=wall,
    )


async def one(url: str, prompt: list[int], args: argparse.Namespace) -> RequestResult:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        return await stream_request(http, "/v1/completions", _body(prompt, args))


def tier_stats(url: str) -> dict[str, Any]:
    """The tier's counters from `/get_server_info` (pages, bytes, hit tokens, load seconds)."""
    stats = httpx.get(f"{url}/get_server_info", timeout=60).json()["engine_stats"]
    return {k: v for k, v in stats.items() if k.startswith("hicache_")}


def spec_for(system: str, args: argparse.Namespace, port: int, num_pages: int, store: Path) -> (
    ServerSpec
):  # fmt: skip
    pool = ["--num-pages", str(num_pages), "--page-size", str(PAGE)]
    if args.max_prefill_tokens:
        pool += ["--max-prefill-tokens", str(args.max_prefill_tokens)]
    if system == "radixlm":
        return radixlm_spec(port, args.model_dir, args.threads, pool)
    if system.startswith("radixlm-tier"):
        tier = ["--hicache-storage-dir", str(store), "--hicache-size", str(args.hicache_size)]
        if system == "radixlm-tier-wt":
            tier += ["--hicache-write-policy", "write_through"]
        spec = radixlm_spec(port, args.model_dir, args.threads, [*pool, *tier])
        return ServerSpec(system, spec.cmd, spec.env, spec.ready_timeout_s)
    venv = ensure_vllm_venv(args.vllm_venv)
    spec = vllm_spec(port, venv, args.model_dir, args.threads)
    # vLLM's CPU attention takes blocks of a multiple of 32 tokens: the same pool in tokens.
    block = VLLM_CPU_BLOCK
    extra = ["--enable-prefix-caching", "--block-size", str(block),
             "--num-gpu-blocks-override", str(num_pages * PAGE // block)]  # fmt: skip
    return ServerSpec(spec.system, [*spec.cmd, *extra], spec.env, spec.ready_timeout_s)


def run_system(
    system: str, args: argparse.Namespace, trace: list[Turn], num_pages: int, logs: Path
) -> SystemResult:
    store = Path(tempfile.mkdtemp(prefix="bench-hicache-"))
    try:
        port = _free_port()
        spec = spec_for(system, args, port, num_pages, store)
        with running_server(spec, port, logs / f"{system}.log") as url:
            results, wall = asyncio.run(run_trace(url, trace, args))
            tier = tier_stats(url) if system.startswith("radixlm-tier") else None
        res = summarize(system, results, wall)
        res.tier = tier
        if system.startswith("radixlm-tier"):  # warm restart over the same directory
            port = _free_port()
            spec = spec_for(system, args, port, num_pages, store)
            with running_server(spec, port, logs / f"{system}-restart.log") as url:
                rng = random.Random(args.seed + 1)
                system_prompt = trace[0].prompt[: args.system_tokens]
                prompt = system_prompt + [rng.randrange(*TOKEN_RANGE) for _ in range(64)]
                r = asyncio.run(one(url, prompt, args))
            res.restart_cached_tokens = r.cached_tokens
            res.restart_prompt_tokens = r.prompt_tokens
            res.restart_ttft = r.ttft
        return res
    finally:
        shutil.rmtree(store, ignore_errors=True)


@dataclass
class ReturningCase:
    """The concurrency-1 returning conversation: tier load vs recomputation, same server."""

    history_tokens: int
    new_tokens: int
    tier_ttft: list[float]
    recompute_ttft: list[float]
    tier_cached_tokens: list[int]
    recompute_cached_tokens: list[int]
    tier_ttft_p50: float = 0.0
    recompute_ttft_p50: float = 0.0
    ratio: float = 0.0  # tier / recompute (the target: <= 0.1)


def returning_case(args: argparse.Namespace, logs: Path) -> ReturningCase:
    rng = random.Random(args.seed + 2)
    history, new = args.returning_tokens, args.returning_new_tokens
    conv_pages = math.ceil((history + new + args.output_tokens) / PAGE)
    num_pages = conv_pages + 8
    filler_tokens = (num_pages - 1) * PAGE  # needs every page: the conversation is evicted
    quick = argparse.Namespace(**{**vars(args), "output_tokens": 8})
    res = ReturningCase(history, new, [], [], [], [])
    store = Path(tempfile.mkdtemp(prefix="bench-hicache-returning-"))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    try:
        port = _free_port()
        spec = spec_for("radixlm-tier", args, port, num_pages, store)
        with running_server(spec, port, logs / "radixlm-tier-returning.log") as url:
            for _ in range(args.returning_reps):
                conv = tokens(history)
                asyncio.run(one(url, conv, quick))  # the conversation so far, computed
                asyncio.run(one(url, tokens(filler_tokens), quick))  # pushes it to the tier
                time.sleep(1.0)  # let the tier's writer finish: the load reads the files
                prompt = conv + tokens(new)
                r = asyncio.run(one(url, prompt, quick))
                res.tier_ttft.append(r.ttft)
                res.tier_cached_tokens.append(r.cached_tokens)
                httpx.post(f"{url}/flush_cache", timeout=60)  # both tiers
                r = asyncio.run(one(url, prompt, quick))
                res.recompute_ttft.append(r.ttft)
                res.recompute_cached_tokens.append(r.cached_tokens)
                httpx.post(f"{url}/flush_cache", timeout=60)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    res.tier_ttft_p50 = percentile(res.tier_ttft, 50)
    res.recompute_ttft_p50 = percentile(res.recompute_ttft, 50)
    res.ratio = res.tier_ttft_p50 / res.recompute_ttft_p50 if res.recompute_ttft_p50 else 0.0
    return res


def table(results: list[SystemResult]) -> str:
    rows = [
        "| system | returning TTFT p50 / p99 (s) | first-turn TTFT p50 / p99 (s) | output tok/s "
        "| returning cached | ok / failed |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.system} | {r.returning_ttft_p50:.3f} / {r.returning_ttft_p99:.3f} "
            f"| {r.first_ttft_p50:.3f} / {r.first_ttft_p99:.3f} | {r.output_tok_per_s:.1f} "
            f"| {r.returning_cached_share:.0%} | {r.completed} / {r.failed} |"
        )
    return "\n".join(rows)


# KV layouts: layers, KV heads, head dim
LAYOUTS = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}


def bench_codec(args: argparse.Namespace) -> dict[str, float]:
    """GB/s of the tier's data path for one conversation of `--codec-tokens` tokens."""
    import torch

    from radixlm.kernels.forward_batch import KVCache
    from radixlm.radix.tier import FileTierStore, HostTierStore, identity_digest
    from radixlm.runtime.hicache_io import KVPageIO

    layers, heads, dim = LAYOUTS[args.layout]
    n = math.ceil(args.codec_tokens / PAGE)
    kv = KVCache.allocate(layers, 2 * n, PAGE, heads, dim, torch.bfloat16, args.device)
    for b in (*kv.k_buffers, *kv.v_buffers):
        b.normal_()
    io = KVPageIO(kv)
    gb = n * io.page_bytes / 1e9
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def timed(fn: Any) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    out: dict[str, float] = {"gb": gb}
    payloads: list[bytes] = []
    out["pool_to_bytes_gbps"] = gb / timed(lambda: payloads.extend(io.read_pages(range(n))))
    io.write_pages(range(n, 2 * n), payloads)  # the first load allocates the staging buffer
    out["bytes_to_pool_gbps"] = gb / timed(lambda: io.write_pages(range(n, 2 * n), payloads))
    keys = [i.to_bytes(16, "little") for i in range(n)]
    host = HostTierStore(2 * n * io.page_bytes)
    for k, p in zip(keys, payloads, strict=True):
        host.put(k, p)
    t_load = timed(lambda: io.write_pages(range(n, 2 * n), [host.get(k) for k in keys]))
    out["host_tier_load_gbps"] = gb / t_load
    tmp = Path(tempfile.mkdtemp(prefix="bench-hicache-codec-"))
    try:
        store = FileTierStore(tmp, 2 * n * io.page_bytes, identity_digest({"bench": 1}))

        def write_all() -> None:
            for k, p in zip(keys, payloads, strict=True):
                store.put(k, p)
            store.wait_writes()

        out["file_write_fsync_gbps"] = gb / timed(write_all)
        store.close()
        again = FileTierStore(tmp, 2 * n * io.page_bytes, identity_digest({"bench": 1}))
        # as `HiCache.fetch` reads: into a reused buffer of the conversation's pages
        pb = io.page_bytes
        buf = memoryview(bytearray(n * pb))
        out["file_read_verify_gbps"] = gb / timed(
            lambda: [again.get(k, buf[i * pb : (i + 1) * pb]) for i, k in enumerate(keys)]
        )
        again.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def add_trace_args(p: argparse.ArgumentParser, conversations: int, turns: int) -> None:
    """The trace's shape (`make_trace`) and the pool's share of its working set."""
    p.add_argument("--conversations", type=int, default=conversations)
    p.add_argument("--turns", type=int, default=turns)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--turn-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pool-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)


def parse_args() -> argparse.Namespace:
    from radixlm.runtime.models.loader import cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default="radixlm-tier,radixlm", help=f"comma list of {SYSTEMS}")
    p.add_argument("--model-dir", type=Path, default=None, help="default: the default model")
    add_trace_args(p, conversations=48, turns=4)
    p.add_argument("--hicache-size", type=float, default=4.0, help="GB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-venv", type=Path, default=cache_dir() / "peers" / "vllm-venv")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--codec-only", action="store_true", help="the tier's data path only")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--codec-tokens", type=int, default=2048)
    p.add_argument(
        "--max-prefill-tokens", type=int, default=256,
        help="radixlm's --max-prefill-tokens (the step's prefill tokens, shortest remaining "
        "first; 0: radixlm's default, unbounded but by --max-batched-tokens)",
    )  # fmt: skip
    p.add_argument("--returning-case", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--returning-tokens", type=int, default=2048)
    p.add_argument("--returning-new-tokens", type=int, default=32)
    p.add_argument("--returning-reps", type=int, default=3)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.codec_only:
        print(f"cpu: {cpu_description()}")
        print(f"load average before: {_loadavg()}")
        res = bench_codec(args)
        print(
            f"{args.layout} bf16 on {args.device}, {args.codec_tokens} tokens ({res['gb']:.3f} GB):"
        )
        for k, v in res.items():
            if k != "gb":
                print(f"  {k}: {v:.2f}")
        print(f"load average after: {_loadavg()}")
        return
    from radixlm.runtime.models.loader import cache_dir, resolve_model_path

    args.model_dir = args.model_dir or resolve_model_path(None)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    trace = make_trace(args, random.Random(args.seed))
    ws = working_set_tokens(trace)
    num_pages = pool_pages(args, trace)
    print(f"cpu: {cpu_description()}")
    print(f"load average before: {_loadavg()}")
    print(
        f"trace: {len(trace)} requests, {args.conversations} conversations x {args.turns} turns, "
        f"{args.system_prompts} system prompts; working set {ws} tokens; pool {num_pages} pages "
        f"of {PAGE} ({num_pages * PAGE / ws:.0%} of the working set)",
        flush=True,
    )
    logs = cache_dir() / "peers" / "logs"
    returning = None
    if args.returning_case:
        returning = returning_case(args, logs)
        print(
            f"returning conversation at concurrency 1 ({returning.history_tokens} tokens + "
            f"{returning.new_tokens} new): TTFT p50 {returning.tier_ttft_p50:.3f} s from the "
            f"tier vs {returning.recompute_ttft_p50:.3f} s recomputed ({returning.ratio:.2f}x; "
            f"cached {returning.tier_cached_tokens} vs {returning.recompute_cached_tokens})",
            flush=True,
        )
    results = []
    for system in systems:
        res = run_system(system, args, trace, num_pages, logs)
        results.append(res)
        print(json.dumps(asdict(res)), flush=True)
    print(table(results))
    for r in results:
        if r.tier:
            t = r.tier
            print(
                f"{r.system} tier: {t['hicache_pages']} pages ({t['hicache_bytes'] / 1e6:.1f} MB), "
                f"{t['hicache_hit_tokens']} hit tokens, {t['hicache_loaded_pages']} pages loaded "
                f"in {t['hicache_load_seconds']:.3f} s"
            )
        if r.restart_cached_tokens is not None:
            print(
                f"{r.system} after a restart: {r.restart_cached_tokens} of "
                f"{r.restart_prompt_tokens} prompt tokens cached, TTFT {r.restart_ttft:.3f} s"
            )
    print(f"load average after: {_loadavg()}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"cpu": cpu_description(), "args": {k: str(v) for k, v in vars(args).items()},
                   "num_pages": num_pages, "working_set_tokens": ws,
                   "results": [asdict(r) for r in results],
                   "returning_case": asdict(returning) if returning else None}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
