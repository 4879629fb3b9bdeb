"""Online serving: Poisson arrivals at several request rates against a live `radixlm serve`.

    .venv/bin/python benchmarks/serving.py [--rates 1,2,4] [--num-requests 30] [--max-tokens 32]
        [--url http://127.0.0.1:30000] [--api-key KEY] [--dtype bfloat16] [--threads 2]
        [--out benchmarks/results/serving.json] [--plot benchmarks/results/serving.png]

Without `--url` it starts its own server (`python -m radixlm.cli serve` on a free port, the
default model) and stops it at the end. Each request is a streamed chat completion over HTTP
(`/v1/chat/completions`, `stream_options.include_usage`) whose system prompt is one of a few
shared ~200-token prompts, so the radix cache has prefixes to reuse, with `ignore_eos` so every
request generates exactly `--max-tokens` tokens. The cache is flushed before each rate.

Per rate: completed requests, wall time, request and output-token throughput, TTFT (request
sent -> first content token) and TPOT ((last token - first token) / (tokens - 1)) p50 / p99,
end-to-end latency, and the cache hit rate (`usage.prompt_tokens_details.cached_tokens` over
prompt tokens). Prints a markdown table, writes JSON and a PNG plot (matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

TOPICS = ["astronomy", "cooking", "gardening", "chess", "woodworking", "sailing"]
QUESTIONS = [
    "Give me one tip for a beginner.",
    "What is a common mistake?",
    "Name a useful tool and say why.",
    "What should I learn first?",
    "Describe a fun weekend project.",
    "How do I know I am improving?",
]


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class RateResult:
    rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_s: float
    cache_hit_rate: float


def system_prompt(topic: str) -> str:
    line = f"You are a patient expert in {topic}. Answer in one or two short sentences. "
    return (line * 12).strip()


def make_workload(n: int, rng: random.Random) -> list[list[dict[str, str]]]:
    return [
        [
            {"role": "system", "content": system_prompt(rng.choice(TOPICS))},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ]
        for _ in range(n)
    ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def one_request(
    client: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int
) -> RequestResult:
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return await stream_request(client, "/v1/chat/completions", body)


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> RequestResult:
    """POST a streaming OpenAI request (`/v1/completions` or `/v1/chat/completions`) and time it.

    A chunk carries a token when its choice has non-empty `text` (completions) or
    `delta.content` (chat). Output tokens come from the final `usage` chunk; a server that sends
    none is counted by content chunks (one token per chunk).
    """
    t0 = time.perf_counter()
    first = last = 0.0
    chunks = 0
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                return RequestResult(ok=False, error=(await r.aread()).decode()[:200])
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    return RequestResult(ok=False, error=str(msg)[:200])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices") or []:
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
                        chunks += 1
    except httpx.HTTPError as exc:
        return RequestResult(ok=False, error=repr(exc))
    end = time.perf_counter()
    tokens = usage.get("completion_tokens") or chunks
    return RequestResult(
        ok=True,
        ttft=(first or end) - t0,
        tpot=(last - first) / (tokens - 1) if tokens > 1 and first else 0.0,
        e2e=end - t0,
        output_tokens=tokens,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    )


async def run_rate(
    url: str, headers: dict[str, str], rate: float, workload: list, max_tokens: int, seed: int
) -> RateResult:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(workload), max_keepalive_connections=len(workload))
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=600, limits=limits
    ) as client:
        r = await client.post("/flush_cache")
        r.raise_for_status()
        tasks = []
        start = time.perf_counter()
        for messages in workload:
            tasks.append(asyncio.create_task(one_request(client, messages, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    for r in results:
        if not r.ok:
            print(f"  request failed: {r.error}", file=sys.stderr)
    prompt = sum(r.prompt_tokens for r in ok)
    return RateResult(
        rate=rate,
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=sum(r.output_tokens for r in ok) / duration,
        ttft_p50_ms=1000 * percentile([r.ttft for r in ok], 50),
        ttft_p99_ms=1000 * percentile([r.ttft for r in ok], 99),
        tpot_p50_ms=1000 * percentile([r.tpot for r in ok if r.tpot], 50),
        tpot_p99_ms=1000 * percentile([r.tpot for r in ok if r.tpot], 99),
        e2e_p50_s=statistics.median([r.e2e for r in ok]) if ok else float("nan"),
        cache_hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
    )


# ---- server ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(args: argparse.Namespace) -> Iterator[str]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "radixlm.cli", "serve", "--port", str(port),
        "--dtype", args.dtype, "--num-threads", str(args.threads), "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RADIXLM_API_KEY", None)
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start in 300 s")
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- report ------------------------------------------------------------------------------------


def table(results: list[RateResult]) -> str:
    head = (
        "| rate (req/s) | done | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
        "| e2e p50 (s) | cache hit |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {r.rate:g} | {r.completed}/{r.completed + r.failed} | {r.request_throughput:.2f} "
        f"| {r.output_throughput:.1f} | {r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f} "
        f"| {r.tpot_p50_ms:.0f} / {r.tpot_p99_ms:.0f} | {r.e2e_p50_s:.2f} "
        f"| {r.cache_hit_rate:.0%} |"
        for r in results
    ]
    return "\n".join([head, *rows])


def plot(results: list[RateResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r.rate for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(rates, [r.output_throughput for r in results], "o-")
    axes[0].set(title="output throughput", xlabel="request rate (req/s)", ylabel="tokens/s")
    axes[1].plot(rates, [r.ttft_p50_ms for r in results], "o-", label="p50")
    axes[1].plot(rates, [r.ttft_p99_ms for r in results], "s--", label="p99")
    axes[1].set(title="time to first token", xlabel="request rate (req/s)", ylabel="ms")
    axes[2].plot(rates, [r.tpot_p50_ms for r in results], "o-", label="p50")
    axes[2].plot(rates, [r.tpot_p99_ms for r in results], "s--", label="p99")
    axes[2].set(title="time per output token", xlabel="request rate (req/s)", ylabel="ms")
    for ax in axes[1:]:
        ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--api-key", default=os.environ.get("RADIXLM_API_KEY"))
    p.add_argument("--rates", default="1,2,4", help="comma list of request rates (req/s)")
    p.add_argument("--num-requests", type=int, default=30, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--threads", type=int, default=2, help="server torch threads (own server)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/serving.json"))
    p.add_argument("--plot", type=Path, default=Path("benchmarks/results/serving.png"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with local_server(args) if args.url is None else _given(args.url) as url:
        results = []
        for i, rate in enumerate(rates):
            workload = make_workload(args.num_requests, random.Random(args.seed + i))
            print(f"rate {rate:g} req/s: {args.num_requests} requests ...", flush=True)
            res = asyncio.run(
                run_rate(url, headers, rate, workload, args.max_tokens, args.seed + i)
            )
            results.append(res)
            print(table([res]).splitlines()[-1], flush=True)
    print()
    print(table(results))
    title = (
        f"radixlm serve, default model, {args.dtype}, {args.num_requests} chat requests/rate, "
        f"{args.max_tokens} output tokens, Poisson arrivals"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: str(v) for k, v in vars(args).items() if k != "api_key"}}
    record["results"] = [asdict(r) for r in results]
    args.out.write_text(json.dumps(record, indent=2))
    plot(results, args.plot, title)
    print(f"\nwrote {args.out} and {args.plot}")


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


if __name__ == "__main__":
    main()
