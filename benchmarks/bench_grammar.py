"""Grammar costs on the default model's tokenizer (SmolLM2, vocab 49152), both backends.

    .venv/bin/python benchmarks/bench_grammar.py [--threads 1] [--reps 5] [--skip-slow]
        [--out benchmarks/results/grammar.json]

Measures, on the CPU of whatever box runs it (nothing here asserts on the numbers):
- compile time per constraint kind (a fresh backend compile each rep: no cache), median;
- per-token ``fill_bitmask`` / ``accept_token`` / ``fork`` / ``jump_forward`` while walking the
  tokens of a JSON document through a schema (fork and jump run on a copy at every position);
- ``apply_token_bitmask`` on ``[B, 49152]`` logits for B = 8, 32 (xgrammar's CPU kernel vs the
  torch twin), float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.grammar.base import get_backend
from radixlm.runtime.grammar.bitmask import (
    allocate_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_torch,
)
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.jump_forward import jump_forward
from radixlm.runtime.grammar.vocab import TokenVocab
from radixlm.runtime.models.loader import load_tokenizer, resolve_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = (
    '{"name":"Ada Lovelace","age":36,"email":"ada@example.org","tags":["red","blue"],'
    '"address":{"street":"12 St James\'s Square","zip":"SW1Y 4JH"}}'
)
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": r"(\+1 )?\(\d{3}\) \d{3}-\d{4}|[a-z]+@[a-z]+\.(com|org)"},
    "ebnf": {"ebnf": 'root ::= "SELECT " cols " FROM " [a-z]+ ";"\ncols ::= [a-z]+ (", " [a-z]+)*'},
    "choices": {"choices": [f"option {i}: {w}" for i, w in enumerate("abcdefghij" * 2)]},
    "json_object": {"json_object": True},
}


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_compile(backends: dict[str, Any], reps: int, skip_slow: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, backend in backends.items():
        for kind, params in CONSTRAINTS.items():
            c = Constraint.from_params(**params)
            assert c is not None
            if kind not in backend.kinds:
                continue
            slow = name == "outlines" and kind == "json_object"
            if slow and skip_slow:
                continue
            fn = backend.compile
            out[f"{name}/{kind}"] = _median_ms(lambda c=c, fn=fn: fn(c), 1 if slow else reps)
    return out


def bench_per_token(backends: dict[str, Any], tokenizer: Any, vocab: TokenVocab) -> dict[str, Any]:
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    c = Constraint.from_params(json_schema=SCHEMA)
    out: dict[str, Any] = {"tokens": len(ids)}
    mask = allocate_bitmask(1, vocab.vocab_size)
    for name, backend in backends.items():
        compiled = backend.compile(c)
        fills, accepts, forks, jumps = [], [], [], []
        for _ in range(5):
            m = compiled.new_matcher()
            for t in ids:
                t0 = time.perf_counter()
                m.fill_bitmask(mask, 0)
                t1 = time.perf_counter()
                assert m.accept_token(t)
                t2 = time.perf_counter()
                probe = m.fork()
                t3 = time.perf_counter()
                jump_forward(probe, vocab, [t])
                t4 = time.perf_counter()
                fills.append(t1 - t0)
                accepts.append(t2 - t1)
                forks.append(t3 - t2)
                jumps.append(t4 - t3)
        series = {"fill": fills, "accept": accepts, "fork": forks, "jump_forward": jumps}
        for label, xs in series.items():
            xs.sort()
            out[f"{name}/{label}_us_median"] = 1e6 * statistics.median(xs)
            out[f"{name}/{label}_us_p90"] = 1e6 * xs[int(0.9 * len(xs))]
    return out


def bench_apply(vocab_size: int, reps: int) -> dict[str, Any]:
    """Masking is idempotent: the same logits are masked again and again, in place."""
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    impls = {"xgrammar": apply_token_bitmask, "torch": apply_token_bitmask_torch}
    for batch in (8, 32):
        words = (vocab_size + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), generator=gen)
        mask = mask.to(torch.int32)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(batch, vocab_size, generator=gen).to(dtype)
            for label, fn in impls.items():
                fn(logits, mask)  # warm-up
                times = []
                for _ in range(reps * 4):
                    start = time.perf_counter()
                    fn(logits, mask)
                    times.append(time.perf_counter() - start)
                key = f"B={batch}/{str(dtype).removeprefix('torch.')}/{label}"
                out[key] = 1e3 * statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-slow", action="store_true", help="skip outlines json_object (~5 s)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(resolve_model_path(None))
    vocab_size = 49152
    t0 = time.perf_counter()
    vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, [tokenizer.eos_token_id])
    setup = {"vocab_ms": 1e3 * (time.perf_counter() - t0)}
    backends = {}
    for name in ("xgrammar", "outlines"):
        t0 = time.perf_counter()
        backends[name] = get_backend(name)(vocab)
        setup[f"{name}_backend_init_ms"] = 1e3 * (time.perf_counter() - t0)
    results = {
        "machine": {"platform": platform.platform(), "threads": args.threads},
        "setup_ms": setup,
        "compile_ms": bench_compile(backends, args.reps, args.skip_slow),
        "per_token": bench_per_token(backends, tokenizer, vocab),
        "apply_ms": bench_apply(vocab_size, args.reps),
    }
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
