"""KV bytes one sequence holds on a model with sliding-window layers (Gemma 3), dense pool vs the
hybrid pool (`HybridBlockPool`): computed from the model's config, and measured from the pool's
counters while one sequence is prefilled in chunks and decoded through `PageManager` (the
scheduler's page code; no forward runs, so nothing here is timed).

    .venv/bin/python benchmarks/bench_swa_memory.py [--model gemma-3-270m] [--tokens 8192]
        [--chunk 2048] [--decode 64] [--page-size 16] [--dtype bfloat16]
        [--out benchmarks/results/swa_memory.json]

Reported: the geometry (layers, window layers, window, KV heads, head dim), per-token bytes of
one layer, and at `--tokens` tokens: the dense pool's bytes (every layer, every position), the
hybrid pool's computed bytes (full layers every position, window layers the last W), and the
measured bytes: full pages held x full-layer page bytes + window pages held x window-layer page
bytes. `most_window_pages_held`: the peak during a step (the window plus the chunk computed).
`cached_window_pages`: window pages the radix tree retains for prefix hits after the window
moved on (prefill chunks are cached); evictable (`evict_swa`), so not counted as held.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from radixlm.kernels.forward_batch import KVCache
from radixlm.kernels.hybrid import HybridKVCache
from radixlm.radix import HybridBlockPool, RadixCache
from radixlm.runtime.models.loader import resolve_model_path
from radixlm.runtime.models.model_info import load_model_info
from radixlm.runtime.request import Request
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.pages import PageManager

MIB = 2**20


def windows_of(cfg) -> list[int]:
    """Each layer's window (0: full attention), from `layer_types` as transformers reads it."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    w = int(getattr(cfg, "sliding_window", 0) or 0)
    return [w if t == "sliding_attention" else 0 for t in types]


def measure(windows: list[int], args, per_full: int, per_window: int) -> dict:
    """One sequence of `args.tokens`: prefill in chunks (cached in the tree, as the scheduler
    does), then `args.decode` single-token steps; the pool's counters at the end."""
    ps, n = args.page_size, args.tokens
    pages = -(-n // ps) + 2
    pool = HybridBlockPool(pages, pages, ps, max(windows))
    pm = PageManager(pool, RadixCache(pool))
    prompt = n - args.decode
    req = Request("r", list(range(prompt)), SamplingParams(max_new_tokens=args.decode))
    most_window = 0
    while req.num_computed_tokens < n:
        step = max(1, min(args.chunk, prompt - req.num_computed_tokens))
        if step == 1 and req.num_tokens == req.num_computed_tokens:
            req.token_ids.append(0)  # a decoded token
        assert pm.try_grow(req, req.num_computed_tokens + step)
        most_window = max(most_window, pool.windows.num_held)  # during the step's forward
        req.num_computed_tokens += step
        if req.num_computed_tokens <= prompt:
            pm.cache_computed(req)
        pm.slide_window(req)
    pm.check_integrity([req], [])
    full_pages, window_pages = pool.num_held, pool.windows.num_held
    return {
        "full_pages_held": full_pages,
        "window_pages_held": window_pages,
        "most_window_pages_held": most_window,
        "cached_window_pages": pool.num_swa_cached,
        "bytes": full_pages * per_full + window_pages * per_window,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results/swa_memory.json")
    args = ap.parse_args()
    cfg = load_model_info(resolve_model_path(args.model)).hf_config
    windows = windows_of(cfg)
    if not any(windows):
        sys.exit(f"{args.model} has no sliding-window layer")
    dtype = getattr(torch, args.dtype)
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
    layer_token = KVCache.bytes_per_page(1, 1, kv_heads, head_dim, dtype)
    per_full, per_window = HybridKVCache.bytes_per_page(
        windows, args.page_size, kv_heads, head_dim, dtype
    )
    n, w = args.tokens, max(windows)
    n_win = sum(1 for x in windows if x)
    dense = len(windows) * n * layer_token
    computed = ((len(windows) - n_win) * n + n_win * min(n, w)) * layer_token
    measured = measure(windows, args, per_full, per_window)
    result = {
        "model": args.model,
        "layers": len(windows),
        "window_layers": n_win,
        "window": w,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "tokens": n,
        "bytes_per_token_per_layer": layer_token,
        "dense_mib": dense / MIB,
        "hybrid_computed_mib": computed / MIB,
        "hybrid_measured_mib": measured["bytes"] / MIB,
        **measured,
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
