"""Whole-model decode step of a Llama-3-8B-shaped random-weight model: triton vs torch attention.

    .venv/bin/python benchmarks/kernels/bench_model_step.py                  # needs CUDA
        [--batch 32] [--context 2048] [--layers 32] [--page-size 16] [--dtype bfloat16]
        [--backends triton,torch] [--iters 20] [--profile] [--out PATH.json]
    .venv/bin/python benchmarks/kernels/bench_model_step.py --smoke          # CPU, interpreter

The model is `radixlm.runtime.models.llama.LlamaForCausalLM` built from a Llama-3-8B config
(hidden 4096, 32 layers, 32 heads / 8 KV heads, head dim 128, MLP 14336, vocab 128256, rope
theta 500000) with random weights (no checkpoint: ~16 GB of bf16 weights at 32 layers; use
`--layers` to shrink). Every request has `context - 1` tokens in the paged KV cache (scattered
pages) and decodes one token; a step is `attn.init_forward(batch)` + the forward (the same work
as `ModelRunner.forward`), timed with CUDA events over `--iters` steps after warm-up; ms/step
and tokens/s are reported per backend, and the logits of the two backends are compared.
KV cache size: 2 * layers * batch * context * 8 * 128 * 2 bytes (8 GiB at the defaults).

`--smoke` runs a tiny config in Triton's CPU interpreter to check that the script works; its
timings mean nothing and are labelled so. Without CUDA and without `--smoke` it exits with a
message (status 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--backends", default="triton,torch")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--profile",
        action="store_true",
        help="CUDA: torch.profiler over 5 steps per backend: GPU kernel time per step, top kernels",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (interpreter)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def build_model(params: dict, device, dtype):
    """Random-weight model on `device` (weights ~N(0, 0.02), norms ~1)."""
    import torch
    from transformers import LlamaConfig

    from radixlm.runtime.models.llama import LlamaForCausalLM

    config = LlamaConfig(**params)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    # NOTE: non-persistent RoPE tables were on meta; rebuild them (as ModelRunner does).
    model.rotary = type(model.rotary)(config, model.head_dim, config.max_position_embeddings)
    model.rotary.to(device)
    return model.eval(), config


def profile_steps(step, label: str, n: int) -> float:
    """GPU kernel time per step (sum of kernel durations) under torch.profiler; prints it next
    to the top kernels. Wall time well above it means the step is bound by host launches."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / n / 1e3
    print(f"{label:>7}: GPU kernel time {gpu_ms:.2f} ms/step; top kernels:")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]:
        share = e.self_device_time_total / n / 1e3
        print(f"         {share:7.3f} ms  x{e.count // n:<4d} {e.key[:90]}")
    return gpu_ms


def main() -> None:
    args = parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit(
            "bench_model_step.py measures a GPU decode step and needs CUDA; none is available "
            "here (use --smoke for a tiny CPU interpreter run that checks the script)"
        )
    params = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        torch.set_num_threads(1)
        params = TINY
        args.batch, args.context, args.page_size, args.dtype, args.iters = 2, 20, 4, "float32", 1

    from radixlm.kernels.forward_batch import ForwardBatch, KVCache
    from radixlm.kernels.registry import create_attention_backend

    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model, config = build_model(params, device, dtype)
    b, ctx, ps = args.batch, args.context, args.page_size
    pages_per_seq = -(-ctx // ps)
    num_pages = b * pages_per_seq + 1
    cache = KVCache.allocate(
        config.num_hidden_layers, num_pages, ps, config.num_key_value_heads, model.head_dim,
        dtype, device,
    )  # fmt: skip
    for buf in (*cache.k_buffers, *cache.v_buffers):
        buf.normal_()
    perm = torch.randperm(num_pages)[: b * pages_per_seq].view(b, pages_per_seq).tolist()
    tokens = torch.randint(0, config.vocab_size, (b,)).tolist()
    batch = ForwardBatch.build([[t] for t in tokens], [ctx - 1] * b, perm, [[0]] * b, ps, device)

    name = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)"
    print(
        f"device: {name}   layers={config.num_hidden_layers} hidden={config.hidden_size} "
        f"batch={b} context={ctx} page_size={ps} {args.dtype}"
    )
    if not cuda:
        print("SMOKE RUN on CPU under TRITON_INTERPRET: timings are not GPU figures")
    results: dict = {
        "device": name,
        "measured_on_gpu": cuda,
        "config": {k: v for k, v in params.items()},
        "batch": b,
        "context": ctx,
        "page_size": ps,
        "dtype": args.dtype,
        "backends": {},
    }
    logits = {}
    for backend in args.backends.split(","):
        attn = create_attention_backend(backend, cache)

        def step(attn=attn) -> torch.Tensor:
            attn.init_forward(batch)
            return model(batch, attn)

        logits[backend] = step()
        for _ in range(2):
            step()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                step()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.iters
        else:
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            ms = (time.perf_counter() - t0) * 1e3 / args.iters
        results["backends"][backend] = {"ms_per_step": ms, "tokens_per_s": b / (ms * 1e-3)}
        print(f"{backend:>7}: {ms:9.2f} ms/step   {b / (ms * 1e-3):9.1f} tok/s")
        if args.profile and cuda:
            gpu_ms = profile_steps(step, backend, 5)
            results["backends"][backend]["gpu_kernel_ms_per_step"] = gpu_ms
    if len(logits) > 1:
        first, *rest = logits
        for other in rest:
            diff = (logits[first] - logits[other]).abs().max().item()
            same = (logits[first].argmax(-1) == logits[other].argmax(-1)).float().mean().item()
            print(f"max |logits {first} - {other}| = {diff:.3g}; same argmax for {same:.0%}")
            results[f"max_abs_logit_diff_{first}_{other}"] = diff
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
