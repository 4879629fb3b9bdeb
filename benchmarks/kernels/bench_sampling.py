"""The sampling step on CPU: the compiled ops (`kernels/cpu/sampling_ops.cpp`) against their torch
twins, A/B in one process, alternated every iteration.

    .venv/bin/python benchmarks/kernels/bench_sampling.py [--threads 2] [--iters 50]
        [--rows 8] [--decode-tokens 64] [--out benchmarks/results/sampling.json]

- `sampler`: `Sampler.__call__` on `--rows` rows of SmolLM2's 49152 logits (float32): greedy,
  temperature 0.8 (the compiled `sample_rows` vs torch's divide / softmax / cumsum / search),
  temperature with top-p 0.95 (`sample_rows` vs torch's top-k candidates or full sort; these
  logits are flat, the nucleus is most of the vocabulary: torch sorts the whole row);
- `redraw`: one verifier redraw of a row after a refused token (`Sampler.redraw`, the compiled
  `redraw_row_` vs its torch twin);
- `decode`: the real default model in process (`Engine`, bf16), `--rows` requests decoding
  `--decode-tokens` tokens at temperature 0.8, alone, with top-p 0.95 and with top-k 50 (EOS
  ignored), output tok/s with the compiled sampler vs the torch one, runs alternated (3 each).

Prints the CPU flags and the load average; medians; asserts nothing on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_forward import cpu_flags  # noqa: E402
from bench_huge_pages import ab  # noqa: E402

import radixlm.runtime.sampler as sampler_mod  # noqa: E402
from radixlm.runtime.sampler import RowDraw, Sampler  # noqa: E402
from radixlm.runtime.sampling_batch import SamplingBatchInfo  # noqa: E402
from radixlm.runtime.sampling_params import SamplingParams  # noqa: E402

V = 49152


class _TorchOnly:
    """Run ``fn`` with the sampler's compiled ops off (its torch twins)."""

    def __enter__(self) -> None:
        self.saved = sampler_mod._cpu_op
        sampler_mod._cpu_op = lambda x: None

    def __exit__(self, *exc: object) -> None:
        sampler_mod._cpu_op = self.saved


def torch_only(fn):
    def run():
        with _TorchOnly():
            return fn()

    return run


def info_for(params: list[SamplingParams]) -> SamplingBatchInfo:
    b = len(params)
    return SamplingBatchInfo.build(
        params, [None] * b, [[] for _ in range(b)], [[] for _ in range(b)], V, "cpu"
    )


def sampler_cases(rows: int, iters: int) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, V, generator=gen) * 3  # [rows, V]
    sampler = Sampler(seed=0)
    out = []
    for name, params in (
        ("greedy", SamplingParams(temperature=0.0)),
        ("temperature 0.8", SamplingParams(temperature=0.8)),
        ("temperature 0.8, top-p 0.95", SamplingParams(temperature=0.8, top_p=0.95)),
    ):
        info = info_for([params] * rows)

        def step(info: SamplingBatchInfo = info) -> None:
            sampler(logits, info)

        compiled, twin = ab(step, torch_only(step), iters)
        out.append(
            {"case": f"sampler {name}", "rows": rows, "compiled_ms": compiled, "torch_ms": twin}
        )
    masked = logits[0].clone()
    masked[::3] = float("-inf")
    probs = (logits[0] / 0.8).softmax(-1)

    def redraw() -> None:
        sampler.redraw(RowDraw(False, probs.clone()), masked, None)

    compiled, twin = ab(redraw, torch_only(redraw), iters)
    out.append({"case": "redraw, one row", "rows": 1, "compiled_ms": compiled, "torch_ms": twin})
    return out


def decode_cases(rows: int, tokens: int, threads: int) -> list[dict[str, object]]:
    from radixlm import Engine

    eng = Engine(dtype="bfloat16", num_threads=threads)
    out = [decode_case(eng, rows, tokens, {"temperature": 0.8})]
    out.append(decode_case(eng, rows, tokens, {"temperature": 0.8, "top_p": 0.95}))
    out.append(decode_case(eng, rows, tokens, {"temperature": 0.8, "top_k": 50}))
    eng.shutdown()
    return out


def decode_case(eng, rows: int, tokens: int, sampling: dict[str, float]) -> dict[str, object]:
    prompts = [f"Write a long story about a {w} who travels." for w in
               ("cat", "dog", "robot", "king", "river", "pilot", "tree", "baker")]  # fmt: skip
    prompts = (prompts * rows)[:rows]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, seed=1, **sampling)

    def run() -> float:
        eng.flush_cache()
        t = time.perf_counter()
        res = eng.generate(prompts, params)
        n = sum(len(r.outputs[0].output_token_ids) for r in res)
        return n / (time.perf_counter() - t)

    run()
    compiled, twin = [], []
    for _ in range(3):
        compiled.append(run())
        with _TorchOnly():
            twin.append(run())
    name = ", ".join(f"{k} {v}" for k, v in sampling.items())
    return {
        "case": f"decode tok/s, {name}",
        "rows": rows,
        "compiled_tok_s": statistics.median(compiled),
        "torch_tok_s": statistics.median(twin),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("cpu flags:", cpu_flags(), "| load average at start:", os.getloadavg())
    results = sampler_cases(args.rows, args.iters)
    for r in results:
        ratio = r["torch_ms"] / r["compiled_ms"]
        print(f"{r['case']:32s} rows {r['rows']}: compiled {r['compiled_ms']:.3f} ms, "
              f"torch {r['torch_ms']:.3f} ms ({ratio:.1f}x)")  # fmt: skip
    if args.decode_tokens > 0:
        for d in decode_cases(args.rows, args.decode_tokens, args.threads):
            ratio = d["compiled_tok_s"] / d["torch_tok_s"]
            print(f"{d['case']} at batch {d['rows']}: compiled {d['compiled_tok_s']:.1f}, "
                  f"torch {d['torch_tok_s']:.1f} ({ratio:.2f}x)")  # fmt: skip
            results.append(d)
    print("load average at end:", os.getloadavg())
    if args.out:
        args.out.write_text(json.dumps({"cpu_flags": cpu_flags(), "threads": args.threads,
                                        "results": results}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
