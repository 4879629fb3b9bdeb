"""`radixlm` console script.

`radixlm generate`: offline generation on the default model. `radixlm serve`: the HTTP server
(OpenAI-compatible and SGLang-native endpoints, Prometheus metrics).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import MISSING, fields
from typing import Any

from radixlm.config import CacheConfig, EngineConfig, SchedulerConfig
from radixlm.runtime.errors import ConfigError

_HELP = {
    "model": "local HF model dir or .gguf file, or gemma-3-270m (its PyPI package installed) "
    "(default: SmolLM2-135M-Instruct, fetched once)",
    "dtype": "bfloat16 | float16 | float32",
    "device": "cuda | cpu (default: cuda if available)",
    "attention_backend": "auto (cpu op on CPU, triton on CUDA) | cpu | torch | triton",
    "num_threads": "torch CPU threads (the forward's team, pinned one per CPU)",
    "enforce_eager": "run the eager reference model instead of the CPU compiled forward "
    "(prepacked oneDNN linears, fused C++ layer ops, one decoder_stack call)",
    "load_format": "auto (the checkpoint's weights) | dummy (random weights from config.json: "
    "benchmarks of a model's shape)",
    "cuda_graph_max_bs": "CUDA: decode batches of up to this many requests replay CUDA graphs "
    "(0: none)",
    "disable_cuda_graph": "CUDA: run every forward eagerly (no CUDA graphs)",
    "quantization": "weight-only quantization: none | int8 (per output channel) | int4 "
    "(groups of --quantization-group-size) | gguf (a .gguf model's own Q8_0/Q4_0/Q4_1/Q4_K "
    "blocks); the embedding is int8 in every quantized mode",
    "quantization_group_size": "int4 group size: 32 | 64 | 128",
    "quantization_lm_head": "the LM head in a quantized mode: int8 (one copy with a tied "
    "embedding) | int4 (faster at batch 1, less accurate)",
    "speculative_draft_model": "with --speculative-algorithm draft: the draft model (HF dir or "
    ".gguf) sharing the target's tokenizer; the target itself with "
    "--speculative-draft-quantization int4 is self-speculation",
    "speculative_draft_quantization": "the draft model's weight-only quantization: none | int8 | "
    "int4 | gguf",
    "speculative_num_draft_tokens": "most draft tokens per request and step (unset: ngram 8, "
    "draft 4)",
    "seed": "seed for requests without their own",
    "debug_integrity": "check KV page accounting after every step (slow)",
    "grammar_backend": "constrained decoding backend: auto (per constraint, the first of "
    "llguidance, xgrammar, outlines that enforces all of it) | llguidance | xgrammar | outlines",
    "enable_jump_forward": "append the text a grammar forces without sampling it "
    "(--disable-jump-forward turns it off)",
    "grammar_timeout_s": "seconds a grammar may take to compile before its request fails",
    "grammar_max_rollbacks": "dead ends of the JSON-schema verifier one request may leave by "
    "rolling back a token (then it fails with grammar_dead_end)",
    "page_size": "tokens per KV page",
    "num_pages": "KV pool size in pages (overrides the memory budget)",
    "kv_memory_bytes": "KV pool budget in bytes",
    "kv_memory_fraction": "KV pool budget as a fraction of free memory",
    "enable_prefix_caching": "share KV pages across requests by prefix (radix cache)",
    "enable_hierarchical_cache": "a second KV tier under the radix cache: pages evicted from "
    "the pool go to host memory (or --hicache-storage-dir) and load back on a prefix match",
    "hicache_size": "the second tier's size in GB (2^30 bytes)",
    "hicache_write_policy": "write_back (pages go to the tier when evicted from the pool, and at "
    "shutdown) | write_through (also as soon as they are cached: survives a crash)",
    "hicache_storage_dir": "keep the second tier in page files under this directory (turns "
    "the tier on; a restarted server finds its earlier prefixes there)",
    "swa_full_tokens_ratio": "sliding-window models: window-layer KV pages per full-layer page "
    "(the window layers' pool; pages outside the window are released)",
    "disable_hybrid_swa_memory": "sliding-window models: keep every layer's K/V for every "
    "position in one pool (no window pool)",
    "max_running_requests": "most requests decoding at once",
    "max_batched_tokens": "token budget of one forward (prefill chunks + decodes)",
    "chunked_prefill_size": "largest prefill chunk per request (0: no chunking)",
    "max_prefill_tokens": "prefill tokens of one forward in all, shortest remaining prompt "
    "first (0 or unset: only --max-batched-tokens bounds them)",
    "schedule_policy": "lpm | fcfs",
    "aging_tokens_per_second": "LPM aging: waited seconds worth this many matched tokens",
    "max_model_len": "context length cap (default: the model's)",
    "tp_size": "tensor parallel ranks (gloo on CPU, NCCL on CUDA)",
    "nnodes": "nodes the tensor parallel ranks span",
    "node_rank": "this node's index; nodes > 0 run workers only, no server",
    "dist_init_addr": "host:port of rank 0's rendezvous (default: $MASTER_ADDR:$MASTER_PORT, "
    "else a free loopback port)",
}


def _str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per engine knob, generated from the config dataclasses."""
    group = parser.add_argument_group("engine")
    for cls in (EngineConfig, CacheConfig, SchedulerConfig):
        for f in fields(cls):
            if f.name in ("cache", "scheduler"):
                continue
            default = f.default if f.default is not MISSING else None
            kind = str(f.type)
            extra: dict[str, Any] = {}
            if "bool" in kind:
                typ: Any = _str2bool
                extra = {"nargs": "?", "const": True}  # `--flag` alone means true
            elif "float" in kind:
                typ = float
            elif "int" in kind:
                typ = int
            else:
                typ = str
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=typ,
                default=default,
                help=f"{_HELP.get(f.name, f.name)} (default: {default})",
                **extra,
            )
    group.add_argument(
        "--disable-jump-forward",
        dest="enable_jump_forward",
        action="store_false",
        help="same as --enable-jump-forward false",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for cls in (EngineConfig, CacheConfig, SchedulerConfig) for f in fields(cls)}
    kw = {k: v for k, v in vars(args).items() if k in names and k not in ("cache", "scheduler")}
    for name in ("chunked_prefill_size", "max_prefill_tokens"):
        if kw.get(name) == 0:
            kw[name] = None
    return kw


def _generate(args: argparse.Namespace) -> int:
    from radixlm import Engine, SamplingParams

    engine = Engine(**engine_kwargs(args))
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p
        )
        for prompt in args.prompt:
            text = prompt
            if args.chat:
                text = engine.apply_chat_template([{"role": "user", "content": prompt}])
            print(f">>> {prompt}")
            t0 = time.perf_counter()
            n = 0
            for delta in engine.stream(text, params):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                n += len(delta.token_ids)
                if delta.error:
                    print(f"\nerror: {delta.error}", file=sys.stderr)
            dt = time.perf_counter() - t0
            print(f"\n[{n} tokens in {dt:.2f} s, {n / max(dt, 1e-9):.1f} tok/s]")
        s = engine.stats()
        print(
            f"[cache hit rate {s.cache_hit_rate:.2f}; KV pages used/cached/free "
            f"{s.kv_pages_used}/{s.kv_pages_cached}/{s.kv_pages_free}]"
        )
    finally:
        engine.shutdown()
    return 0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from radixlm.server.server_config import ServerConfig

    d = ServerConfig()
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=d.host, help=f"address to bind (default: {d.host})")
    group.add_argument("--port", type=int, default=d.port, help=f"port (default: {d.port})")
    group.add_argument(
        "--api-key",
        default=os.environ.get("RADIXLM_API_KEY") or None,
        help="require `Authorization: Bearer KEY` (default: $RADIXLM_API_KEY, else no key)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="model id in /v1/models and responses (default: the model directory's name)",
    )
    group.add_argument(
        "--max-n",
        type=int,
        default=d.max_n,
        help=f"most sequences (n) one request may ask for (default: {d.max_n})",
    )
    group.add_argument(
        "--max-batch-prompts",
        type=int,
        default=d.max_batch_prompts,
        help=f"most prompts in one batched request (default: {d.max_batch_prompts})",
    )
    group.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="data parallel: this many engine replicas behind the smg router on --port "
        "(default: 1, no router)",
    )
    group.add_argument(
        "--router-policy",
        default="cache_aware",
        help="the router's policy with --dp-size > 1: cache_aware | round_robin | random | "
        "power_of_two | least_load (default: cache_aware)",
    )
    group.add_argument(
        "--dashboard-show-text",
        action="store_true",
        help="let /dashboard show the text of cached prefixes (default: token counts and "
        "hashes of token ids only: a prefix can be private)",
    )
    group.add_argument(
        "--log-level",
        default=d.log_level,
        choices=["debug", "info", "warning", "error", "critical"],
        help=f"logging level; debug also logs every HTTP request (default: {d.log_level})",
    )
    _add_limit_args(group, d)


# Limits and overload knobs of `ServerConfig`: flag name -> (field, type, help).
_LIMIT_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--max-body-bytes": ("max_body_bytes", int, "largest request body; 413 past it"),
    "--max-prompt-chars": (
        "max_prompt_chars",
        int,
        "longest prompt in characters, checked before tokenizing (default: 16 x max_model_len)",
    ),
    "--max-stop-strings": ("max_stop_strings", int, "most stop strings per request"),
    "--max-stop-chars": ("max_stop_chars", int, "longest stop string in characters"),
    "--max-top-logprobs": ("max_top_logprobs", int, "most top logprobs per token"),
    "--max-constraint-chars": (
        "max_constraint_chars",
        int,
        "largest JSON schema / regex / EBNF grammar in characters",
    ),
    "--max-schema-depth": ("max_schema_depth", int, "deepest JSON nesting of a schema"),
    "--max-schema-nodes": ("max_schema_nodes", int, "most JSON values in a schema"),
    "--max-logit-bias": ("max_logit_bias", int, "most logit_bias entries per request"),
    "--max-queued-requests": (
        "max_queued_requests",
        int,
        "most prompts waiting for admission; past it requests get 503 with Retry-After",
    ),
    "--request-timeout": (
        "request_timeout_s",
        float,
        "default per-request deadline in seconds (a request's `timeout` field overrides it); "
        "past it the request is aborted and the client gets 408",
    ),
    "--shutdown-timeout": (
        "shutdown_timeout_s",
        float,
        "on SIGTERM / Ctrl-C, seconds running requests get to finish before they are aborted",
    ),
}


def _add_limit_args(group: argparse._ArgumentGroup, defaults: Any) -> None:
    for flag, (name, typ, text) in _LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        group.add_argument(
            flag, dest=name, type=typ, default=default, help=f"{text} (default: {default})"
        )


def server_config(args: argparse.Namespace) -> Any:
    from radixlm.server.server_config import ServerConfig

    return ServerConfig(
        **{name: getattr(args, name) for name, _, _ in _LIMIT_FLAGS.values()},
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_n=args.max_n,
        max_batch_prompts=args.max_batch_prompts,
        log_level=args.log_level,
        dashboard_show_text=args.dashboard_show_text,
    )


def _serve(args: argparse.Namespace) -> int:
    if args.node_rank > 0:
        from radixlm.runtime.distributed.tp_runner import run_worker_node

        return run_worker_node(engine_kwargs(args))
    if args.dp_size > 1:
        from radixlm.server.data_parallel import DataParallelConfig, serve_data_parallel

        dp = DataParallelConfig(dp_size=args.dp_size, policy=args.router_policy)
        return serve_data_parallel(engine_kwargs(args), server_config(args), dp)
    from radixlm.server.launch import serve

    return serve(engine_kwargs(args), server_config(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixlm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline from prompts (streams to stdout)")
    gen.add_argument("prompt", nargs="+", help="one or more prompts")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(gen)
    srv = sub.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI-compatible + SGLang-native API)",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, "
        "/generate, /get_model_info, /health, /metrics, /dashboard, ...",
    )
    add_server_args(srv)
    add_engine_args(srv)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        return _serve(args)
    except ConfigError as exc:  # a configuration that cannot run: one line, not a traceback
        parser.exit(2, f"radixlm {args.command}: error: {exc}\n")


if __name__ == "__main__":
    raise SystemExit(main())
