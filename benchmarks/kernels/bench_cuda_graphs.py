"""Decode step with and without CUDA graphs against the HBM floor, and a returning conversation
loaded from the host-memory KV tier against its recomputation, on a Llama-3-8B-shaped model.

    python benchmarks/kernels/bench_cuda_graphs.py [--batch-sizes 1,32] [--context 1024]
        [--tier-context 8192] [--iters 30] [--out PATH.json]           # needs CUDA
    python benchmarks/kernels/bench_cuda_graphs.py --smoke              # CPU, interpreter

The model is radixlm's `ModelRunner` over a Llama-3-8B config (hidden 4096, 32 layers, 32 / 8
heads, head dim 128, MLP 14336, vocab 128256) with `load_format="dummy"` (random bf16 weights;
no checkpoint), the Triton backend and `cuda_graph_max_bs` = the largest batch.

- **Decode step**: every request has `context - 1` tokens in its pages and decodes one token.
  `eager` is `ModelRunner.forward_eager` (plan + Python layers: ~10 launches per layer), `graph`
  is `ModelRunner.forward` (the batch copied into the static inputs, one replay, the logits
  gathered). Each is timed over `--iters` steps after warm-up, by wall clock with the device
  synchronized at the end (what a step costs the engine) and by CUDA events. The **HBM floor**
  is the bytes a step must read (every weight but the embedding's unread rows, plus each
  request's K/V) over the device-to-device copy bandwidth measured first (bytes read + written
  per second). The graph's logits are compared with the eager ones.
- **Returning conversation** (`--tier-context`): its K/V pages read out of the pool as the host
  tier stores them (`KVPageIO.read_pages`, the tier's page codec), then loaded back into other
  pool pages (`KVPageIO.write_pages`, what `HiCache.load` calls) and the first new token decoded:
  TTFT from the tier = load + that forward; against recomputation = the whole prompt's prefill
  in chunks of `--chunk` tokens.

`--smoke` runs a tiny config in Triton's CPU interpreter (graphs replaced by re-running the
forward) to check that the script works; its timings mean nothing and are labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_step import LLAMA3_8B  # noqa: E402  (the one copy of the shape)

TINY = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=256)  # fmt: skip
SPEC_TBPS = {"H200": 4.8, "H100": 3.35}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tier-context", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk of the recompute")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="kernel time table of an eager step")
    p.add_argument("--engine-concurrency", default="", help="e.g. 1,32: the engine section")
    p.add_argument("--engine-prompt", type=int, default=128)
    p.add_argument("--engine-output", type=int, default=128)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def copy_bandwidth(torch, device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30 if device.type == "cuda" else 1 << 24
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(torch, device)
    t = time.perf_counter()
    reps = 20 if device.type == "cuda" else 3
    for _ in range(reps):
        b.copy_(a)
    sync(torch, device)
    return 2 * n * reps / (time.perf_counter() - t)


def sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(torch, device, fn, iters: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    sync(torch, device)
    events = None
    if device.type == "cuda":
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    if events is not None:
        events[1].record()
    sync(torch, device)
    wall = (time.perf_counter() - t) / iters * 1e3
    out = {"wall_ms": round(wall, 3)}
    if events is not None:
        out["gpu_ms"] = round(events[0].elapsed_time(events[1]) / iters, 3)
    return out


def main() -> int:
    args = parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from radixlm.config import CacheConfig
    from radixlm.kernels.forward_batch import ForwardBatch
    from radixlm.runtime.cuda_graph import eager_capture
    from radixlm.runtime.hicache_io import KVPageIO
    from radixlm.runtime.model_runner import ModelRunner

    if not torch.cuda.is_available() and not args.smoke:
        print("needs CUDA (or --smoke)", file=sys.stderr)
        return 1
    device = torch.device("cpu" if args.smoke else "cuda")
    cfg = TINY if args.smoke else LLAMA3_8B
    if args.smoke:
        args.context, args.tier_context, args.chunk, args.iters = 40, 64, 32, 2
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    ps = args.page_size
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    result: dict = {
        "device": name,
        "torch": torch.__version__,
        "smoke": args.smoke,
        "config": "tiny" if args.smoke else "Llama-3-8B shape, bf16, random weights",
        "context": args.context,
        "page_size": ps,
    }

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    bw = copy_bandwidth(torch, device)
    result["copy_GBps"] = round(bw / 1e9, 1)
    spec = next((v for k, v in SPEC_TBPS.items() if k in name), None)
    result["spec_TBps"] = spec

    from transformers import LlamaConfig

    tmp = Path(tempfile.mkdtemp())
    LlamaConfig(**cfg).save_pretrained(tmp)
    per_req = -(-(max(args.context, args.tier_context) + 8) // ps)
    num_pages = max(max(sizes) * -(-(args.context + 8) // ps), 2 * per_req) + 4
    t0 = time.perf_counter()
    runner = ModelRunner(
        tmp, "bfloat16", device, CacheConfig(page_size=ps, num_pages=num_pages),
        attention_backend="triton", max_model_len=max(args.context, args.tier_context) + 16,
        load_format="dummy", cuda_graph_max_bs=max(sizes),
        graph_capture=eager_capture if args.smoke else None,
    )  # fmt: skip
    result["runner_start_s"] = round(time.perf_counter() - t0, 1)
    graphs = runner.decode_graphs
    result["graph_buckets"] = graphs.buckets
    result["graph_capture_s"] = round(graphs.capture_seconds, 2)
    model = runner.model
    emb = model.embed_tokens.weight
    streamed = runner.weight_bytes  # resident: the embedding's rows are gathered, not streamed
    if getattr(model.lm_head, "weight", None) is not emb:
        streamed -= emb.numel() * emb.element_size()
    kv_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 128 * 2
    if args.smoke:
        kv_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 16 * 2
    result["weights_streamed_GB"] = round(streamed / 1e9, 3)
    result["decode"] = []
    save()

    for b in sizes:
        try:
            npp = -(-(args.context + 8) // ps)
            pages = [list(range(r * npp, (r + 1) * npp)) for r in range(b)]
            batch = ForwardBatch.build(
                [[(1000 + r) % cfg["vocab_size"]] for r in range(b)], [args.context - 1] * b,
                pages, [[0]] * b, ps,
                device,
            )  # fmt: skip
            eager = time_steps(torch, device, lambda fb=batch: runner.forward_eager(fb), args.iters)
            graph = time_steps(torch, device, lambda fb=batch: runner.forward(fb), args.iters)
            diff = (runner.forward(batch) - runner.forward_eager(batch)).abs().max().item()
            floor_bytes = streamed + b * args.context * kv_token
            floor_ms = floor_bytes / bw * 1e3
            row = {
                "batch": b,
                "eager": eager,
                "graph": graph,
                "speedup_wall": round(eager["wall_ms"] / graph["wall_ms"], 2),
                "floor_GB": round(floor_bytes / 1e9, 3),
                "floor_ms_at_copy_bw": round(floor_ms, 3),
                "graph_wall_over_floor": round(graph["wall_ms"] / floor_ms, 2),
                "graph_tok_s": round(b / graph["wall_ms"] * 1e3, 1),
                "logits_max_abs_diff_graph_vs_eager": diff,
            }
            if spec:
                row["floor_ms_at_spec"] = round(floor_bytes / (spec * 1e12) * 1e3, 3)
            if args.profile and device.type == "cuda":
                row["kernels"] = kernel_table(torch, lambda fb=batch: runner.forward_eager(fb))
            result["decode"].append(row)
        except Exception:
            result["decode"].append({"batch": b, "error": traceback.format_exc()[-2000:]})
        save()

    if args.tier_context:
        try:
            result["returning"] = returning(torch, device, runner, ForwardBatch, KVPageIO, args)
        except Exception:
            result["returning"] = {"error": traceback.format_exc()[-2000:]}
        save()
    if args.engine_concurrency:
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            result["engine"] = engine_section(torch, device, cfg, args)
        except Exception:
            result["engine"] = {"error": traceback.format_exc()[-2000:]}
        save()
    print(json.dumps(result, indent=1), flush=True)
    return 0


def engine_section(torch, device, cfg, args) -> list[dict]:
    """Output tok/s of the whole engine (scheduler, executor, sampling) with and without
    graphs: `c` prompts of `--engine-prompt` random tokens submitted together, each decoding
    `--engine-output` tokens (ignore_eos), on the model's shape with SmolLM2's tokenizer (its
    49152-token vocabulary, so every sampled id detokenizes)."""
    import shutil

    from transformers import LlamaConfig

    from radixlm import Engine, SamplingParams
    from radixlm.runtime.models.loader import resolve_model_path

    tok_dir = resolve_model_path(None, need_weights=False)
    model_dir = Path(tempfile.mkdtemp())
    LlamaConfig(**dict(cfg, vocab_size=49152)).save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, model_dir / name)
    sizes = [int(c) for c in args.engine_concurrency.split(",")]
    params = SamplingParams(max_new_tokens=args.engine_output, temperature=0, ignore_eos=True)
    rows = []
    for graphs in (True, False):
        with Engine(
            str(model_dir), dtype="bfloat16", device=str(device), load_format="dummy",
            max_running_requests=max(sizes), cuda_graph_max_bs=max(sizes),
            disable_cuda_graph=not graphs, kv_memory_fraction=0.3,
        ) as engine:  # fmt: skip
            for c in sizes:
                prompts = [
                    [(r * 7919 + j * 104729) % 49000 + 100 for j in range(args.engine_prompt)]
                    for r in range(c)
                ]
                engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
                t = time.perf_counter()
                out = engine.generate(prompts, params)
                dt = time.perf_counter() - t
                n = sum(len(o.output_token_ids) for o in out)
                rows.append({
                    "graphs": graphs and engine.runner.decode_graphs is not None,
                    "concurrency": c,
                    "output_tokens": n,
                    "seconds": round(dt, 3),
                    "output_tok_s": round(n / dt, 1),
                })  # fmt: skip
    return rows


def kernel_table(torch, fn, top: int = 12) -> list[tuple[str, float, int]]:
    """(kernel, GPU ms per step, launches per step) of one step, the most costly first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.key not in ("", "Activity Buffer Request"):
            rows.append((e.key[:80], round(t / 1e3 / steps, 3), e.count // steps))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def returning(torch, device, runner, ForwardBatch, KVPageIO, args) -> dict:
    """TTFT of a returning `tier_context`-token conversation: host tier load vs recompute."""
    ps, n = args.page_size, args.tier_context
    npp = -(-(n + 1) // ps)
    first = list(range(npp))
    second = list(range(npp, 2 * npp))
    ids = [(i * 7919) % (runner.vocab_size - 5) + 5 for i in range(n)]

    def prefill(pages: list[int]) -> None:
        for s in range(0, n, args.chunk):
            chunk = ids[s : s + args.chunk]
            fb = ForwardBatch.build([chunk], [s], [pages], [[len(chunk) - 1]], ps, device)
            runner.forward(fb)

    prefill(first)  # compiles the extend kernels
    sync(torch, device)
    times = []
    for _ in range(2 if args.smoke else 3):
        t = time.perf_counter()
        prefill(first)
        sync(torch, device)
        times.append(time.perf_counter() - t)
    recompute = min(times)
    io = KVPageIO(runner.kv_cache)
    full = n // ps  # whole pages only, as the tier holds
    payloads = [bytes(p) for p in io.read_pages(first[:full])]  # what a host store keeps
    decode = ForwardBatch.build([[7]], [full * ps], [second], [[0]], ps, device)
    loads, ttfts = [], []
    for _ in range(2 if args.smoke else 5):
        sync(torch, device)
        t = time.perf_counter()
        io.write_pages(second[:full], payloads)
        sync(torch, device)
        t1 = time.perf_counter()
        runner.forward(decode)
        sync(torch, device)
        loads.append(t1 - t)
        ttfts.append(time.perf_counter() - t)
    ok = all(
        torch.equal(buf.view(-1, ps, *buf.shape[1:])[first[:full]],
                    buf.view(-1, ps, *buf.shape[1:])[second[:full]])
        for buf in (*runner.kv_cache.k_buffers, *runner.kv_cache.v_buffers)
    )  # fmt: skip
    load = min(loads)
    nbytes = full * io.page_bytes
    return {
        "tokens": n,
        "pages": full,
        "bytes_GB": round(nbytes / 1e9, 3),
        "load_s": round(load, 4),
        "load_GBps": round(nbytes / load / 1e9, 2),
        "ttft_tier_s": round(min(ttfts), 4),
        "ttft_recompute_s": round(recompute, 4),
        "tier_over_recompute": round(min(ttfts) / recompute, 3),
        "loaded_pages_equal": ok,
    }


if __name__ == "__main__":
    sys.exit(main())
