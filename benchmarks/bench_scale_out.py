"""Scale-out: data parallel behind the smg router, and the tensor-parallel step overhead.

    .venv/bin/python benchmarks/bench_scale_out.py [--model DIR] [--conversations 5] [--turns 4]
        [--concurrency 4] [--max-tokens 8] [--tp-steps 20] [--skip-dp] [--skip-tp]
        [--out benchmarks/results/scale_out.json]

DP: one shared-system-prompt workload (`--conversations` chats, each with its own ~200-token
system prompt, `--turns` questions each, `--concurrency` requests in flight) against
(1) one `radixlm serve` replica, (2) `radixlm serve --dp-size 2` (smg, `cache_aware`) and
(3) `--dp-size 2 --router-policy round_robin`. Reports requests/s, output tokens/s and the radix
cache hit rate (`cached_tokens` / prompt tokens, from the responses' usage). On a 2-core box two
replicas share the same cores, so the speed-up is not the point: the hit rate is (a prefix that
reaches both replicas is computed twice).

TP: in-process forwards of a random Llama-shaped model (hidden 512, 8 heads, 4 KV heads, 8
layers) with `ModelRunner` (TP=1) and `TensorParallelRunner` (TP=2, gloo, float32, one thread
per rank): a 256-token prefill and a batch-8 decode, mean ms per forward. The difference is the
all-reduces (two per layer) plus the step broadcast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = "river stone cloud maple copper lantern orbit harbor velvet meadow signal quartz".split()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return [
        f"You are assistant {i}. Background: " + " ".join(rng.choice(WORDS) for _ in range(180))
        for i in range(n)
    ]


def start(model: str, extra: list[str], threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "radixlm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model", model, "--num-threads", str(threads), "--log-level", "warning", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {cmd}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    prompts = system_prompts(args.conversations)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        jobs = [(conv, turn) for turn in range(args.turns) for conv in range(args.conversations)]
        sem = asyncio.Semaphore(args.concurrency)
        usage: list[dict[str, Any]] = []

        async def one(conv: int, turn: int) -> None:
            body = {
                "model": model,
                "messages": [
                    {"role": "system", "content": prompts[conv]},
                    {"role": "user", "content": f"Question {turn}: what do you know?"},
                ],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            async with sem:
                r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            usage.append(r.json()["usage"])

        start_t = time.perf_counter()
        rng = random.Random(1)
        # Turns in order (a conversation's next question comes after its previous answer); the
        # conversations of one turn arrive in a shuffled order, so that round-robin does not pin
        # a conversation to a replica by accident.
        for turn in range(args.turns):
            order = [c for c, t in jobs if t == turn]
            rng.shuffle(order)
            await asyncio.gather(*(one(c, turn) for c in order))
        wall = time.perf_counter() - start_t
    prompt = sum(u["prompt_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    out = sum(u["completion_tokens"] for u in usage)
    return {
        "requests": len(usage),
        "wall_s": round(wall, 2),
        "req_per_s": round(len(usage) / wall, 3),
        "out_tok_per_s": round(out / wall, 2),
        "cache_hit_rate": round(cached / prompt, 3),
    }


def bench_dp(args: argparse.Namespace) -> dict[str, Any]:
    configs = {
        "dp1": [],
        "dp2_cache_aware": ["--dp-size", "2"],
        "dp2_round_robin": ["--dp-size", "2", "--router-policy", "round_robin"],
    }
    results = {}
    for name, extra in configs.items():
        proc, url = start(args.model, [*extra, "--dtype", args.dtype], args.threads)
        try:
            results[name] = asyncio.run(workload(url, args))
        finally:
            stop(proc)
        print(name, results[name], flush=True)
    return results


def _tp_model(tmp: Path) -> Path:
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from radixlm.runtime.models.loader import resolve_model_path

    cfg = AutoConfig.for_model(
        "llama", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=1536, vocab_size=49152,
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp, safe_serialization=True)
    tok_dir = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, tmp / name)
    return tmp


def bench_tp(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from radixlm.config import CacheConfig
    from radixlm.kernels.forward_batch import ForwardBatch
    from radixlm.runtime.distributed.parallel_state import DistributedConfig
    from radixlm.runtime.distributed.tp_runner import TensorParallelRunner
    from radixlm.runtime.model_runner import ModelRunner

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tp_bench_"))
    model_dir = _tp_model(tmp)
    cache = CacheConfig(page_size=16, num_pages=256)
    run_args = (model_dir, "float32", torch.device("cpu"), cache, "auto", None)
    prefill = ForwardBatch.build(
        [list(range(1000, 1256))], [0], [list(range(16))], [[255]], 16, "cpu"
    )
    decode = ForwardBatch.build(
        [[7] for _ in range(8)],
        [100] * 8,
        [list(range(20 + 8 * i, 28 + 8 * i)) for i in range(8)],
        [[0]] * 8,
        16,
        "cpu",
    )

    def timed(runner: Any) -> dict[str, float]:
        out = {}
        for name, batch in (("prefill_256_ms", prefill), ("decode_b8_ms", decode)):
            runner.forward(batch)  # warm-up
            t = time.perf_counter()
            for _ in range(args.tp_steps):
                runner.forward(batch)
            out[name] = round((time.perf_counter() - t) / args.tp_steps * 1000, 2)
        return out

    results = {"tp1": timed(ModelRunner(*run_args))}
    tp = TensorParallelRunner(*run_args, DistributedConfig.from_env(2), num_threads=1)
    try:
        results["tp2"] = timed(tp)
    finally:
        tp.shutdown()
    print("tp", results, flush=True)
    return results


def main() -> None:
    from radixlm.runtime.models.loader import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--conversations", type=int, default=5)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tp-steps", type=int, default=20)
    p.add_argument("--skip-dp", action="store_true")
    p.add_argument("--skip-tp", action="store_true")
    p.add_argument("--out", default=None, help="default: results/scale_out*.json")
    args = p.parse_args()
    args.model = args.model or str(resolve_model_path(None))
    suffix = "_tp" if args.skip_dp else "_dp" if args.skip_tp else ""
    args.out = args.out or str(ROOT / f"benchmarks/results/scale_out{suffix}.json")
    results: dict[str, Any] = {"args": vars(args)}
    if not args.skip_dp:
        results["dp"] = bench_dp(args)
    if not args.skip_tp:
        results["tp"] = bench_tp(args)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
