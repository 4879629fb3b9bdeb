"""Continuous batching (radixlm) vs static batching (transformers `generate`) on one workload.

    .venv/bin/python benchmarks/bench_batching.py [--num-requests 64] [--dtype bfloat16]
        [--seed 0] [--quick] [--out benchmarks/results/batching.json]

Part 1, throughput: the same N requests (random prompts of 32-512 tokens, outputs of 8-256
tokens, mixed) run through
- transformers `generate` in padded batches of 16 (left padding, greedy), each batch run to its
  longest output, in submission order;
- one radixlm `Engine`, all requests submitted at once (a few scheduler settings are tried).
Both sides generate exactly the requested number of tokens per request (EOS is ignored) and only
those "useful" tokens count: output tok/s = useful tokens / wall time.

Part 2, step overhead: with B decode-only requests on a paused engine, the time of one
engine step (`EngineCore.step()`: schedule, executor.run, update, emit) vs a bare
`ModelRunner.forward` of the very same `ForwardBatch`, measured in
pairs (one of each per decode position), plus where the difference goes.

Prompts are distinct random token ids, so the radix cache cannot help: this measures batching
only (the cache is flushed between runs and its hit count is reported). Both sides run in this
one process, one after the other, with the same `torch.set_num_threads`. The numbers are timings
on whatever box runs this; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixlm import Engine, SamplingParams
from radixlm.runtime.request import Request

HF_BATCH_SIZE = 16
TOKEN_ID_RANGE = (100, 40000)  # ordinary (non-special) ids of the SmolLM2 vocabulary
ENGINE_CONFIGS = [  # (max_running_requests, max_batched_tokens, chunked_prefill_size)
    (64, 512, 512),
    (64, 1024, 512),
    (64, 2048, 512),
]
QUICK_CONFIGS = [(64, 512, 512), (64, 1024, 512)]


def now() -> tuple[float, float]:
    """(wall, process CPU) seconds. CPU time (all threads of this process) is the number that
    other work on a shared box disturbs least; wall time is the headline."""
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = now()
    return wall - t0[0], cpu - t0[1]


# ---- workload ---------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, Any]:
        plens = [len(p) for p in self.prompts]
        return {
            "num_requests": len(self.prompts),
            "prompt_tokens": sum(plens),
            "prompt_len_min_mean_max": [min(plens), round(statistics.mean(plens), 1), max(plens)],
            "output_tokens": self.useful_tokens,
            "output_len_min_mean_max": [
                min(self.output_lens),
                round(statistics.mean(self.output_lens), 1),
                max(self.output_lens),
            ],
        }


def make_workload(
    num_requests: int, seed: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> Workload:
    """Distinct random prompts (uniform lengths) and uniform output lengths, from one seed."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_range)
        prompts.append([rng.randint(*TOKEN_ID_RANGE) for _ in range(plen)])
        outs.append(rng.randint(*output_range))
    assert len({tuple(p[:16]) for p in prompts}) == num_requests, "prompts share a first page"
    return Workload(prompts, outs)


# ---- transformers static batching ---------------------------------------------------------------


def run_hf(model_dir: Path, dtype: torch.dtype, wl: Workload, batch_size: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    _hf_generate(model, [[1, 2, 3, 4]], 4, pad)  # warm-up
    outputs: list[list[int]] = []
    batches = []
    t0 = now()
    for i in range(0, len(wl.prompts), batch_size):
        prompts, lens = wl.prompts[i : i + batch_size], wl.output_lens[i : i + batch_size]
        tb = time.perf_counter()
        gen = _hf_generate(model, prompts, max(lens), pad)
        outputs.extend(row[:n] for row, n in zip(gen, lens, strict=True))
        batches.append(
            {
                "size": len(prompts),
                "max_prompt": max(len(p) for p in prompts),
                "max_new_tokens": max(lens),
                "useful_tokens": sum(lens),
                "generated_tokens": len(prompts) * max(lens),
                "seconds": round(time.perf_counter() - tb, 3),
            }
        )
    wall, cpu = since(t0)
    generated = sum(b["generated_tokens"] for b in batches)
    del model
    return {
        "batch_size": batch_size,
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "useful_tokens": wl.useful_tokens,
        "generated_tokens_incl_padding_rows": generated,
        "useful_fraction": round(wl.useful_tokens / generated, 3),
        "output_tok_per_s": round(wl.useful_tokens / wall, 2),
        "output_tok_per_cpu_s": round(wl.useful_tokens / cpu, 2),
        "batches": batches,
        "_outputs": outputs,
    }


@torch.inference_mode()
def _hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int) -> list[list[int]]:
    """One padded batch (left padding), greedy, exactly `new_tokens` tokens per row (EOS is
    suppressed by min_new_tokens, so no row stops early)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
    )
    gen = out[:, width:]
    assert gen.shape[1] == new_tokens, f"HF generated {gen.shape[1]} tokens, wanted {new_tokens}"
    return gen.tolist()


# ---- radixlm continuous batching ----------------------------------------------------------------


def pages_for(wl: Workload, page_size: int) -> int:
    """A KV pool that holds every request at full length at once (no retraction)."""
    need = sum(
        -(-(len(p) + n) // page_size) + 1 for p, n in zip(wl.prompts, wl.output_lens, strict=True)
    )
    return need + 64


def make_engine(args, num_pages: int, cfg: tuple[int, int, int]) -> Engine:
    running, batched, chunk = cfg
    return Engine(
        dtype=args.dtype,
        num_threads=args.threads,
        num_pages=num_pages,
        page_size=16,
        max_running_requests=running,
        max_batched_tokens=batched,
        chunked_prefill_size=chunk,
        schedule_policy=args.policy,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def run_radixlm(args, wl: Workload, cfg: tuple[int, int, int]) -> dict[str, Any]:
    engine = make_engine(args, pages_for(wl, 16), cfg)
    try:
        engine.generate([[1, 2, 3, 4]], [greedy(4)])  # warm-up
        engine.wait_idle()
        engine.flush_cache()
        steps = _record_steps(engine)
        t0 = now()
        results = engine.generate(wl.prompts, [greedy(n) for n in wl.output_lens])
        wall, cpu = since(t0)
        stats = engine.stats()
    finally:
        engine.shutdown()
    outputs = []
    for res, n in zip(results, wl.output_lens, strict=True):
        if res.error or len(res.output_token_ids) != n:
            raise RuntimeError(f"radixlm request failed: {res.error or len(res.output_token_ids)}")
        outputs.append(res.output_token_ids)
    decode = [s for s in steps if s.num_prefill_tokens == 0]
    prefill = [s for s in steps if s.num_prefill_tokens > 0]
    return {
        "max_running_requests": cfg[0],
        "max_batched_tokens": cfg[1],
        "chunked_prefill_size": cfg[2],
        "schedule_policy": args.policy,
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "useful_tokens": wl.useful_tokens,
        "output_tok_per_s": round(wl.useful_tokens / wall, 2),
        "output_tok_per_cpu_s": round(wl.useful_tokens / cpu, 2),
        "num_steps": len(steps),
        "num_decode_only_steps": len(decode),
        "sum_step_seconds": round(sum(s.step_seconds for s in steps), 3),
        "sum_forward_seconds": round(sum(s.forward_seconds for s in steps), 3),
        "loop_seconds_outside_step": round(wall - sum(s.step_seconds for s in steps), 3),
        "decode_only_steps_seconds": round(sum(s.step_seconds for s in decode), 3),
        "decode_only_mean_batch": round(
            statistics.mean([s.num_requests for s in decode] or [0]), 1
        ),
        "prefill_steps_seconds": round(sum(s.step_seconds for s in prefill), 3),
        "cache_hit_tokens": stats.cache_hit_tokens,
        "num_retractions": stats.num_retractions,
        "_outputs": outputs,
    }


def _record_steps(engine: Engine) -> list:
    """Keep every step's `StepStats` (wraps the engine core's `step`, code unchanged)."""
    sched = engine.scheduler
    core = engine.core
    inner = core.step
    steps: list = []

    def step():
        out = inner()
        if sched.last_step.num_tokens:
            steps.append(sched.last_step)
        return out

    core.step = step
    return steps


# ---- step overhead ------------------------------------------------------------------------------


@dataclass
class PhaseTimer:
    """Wraps instance methods to accumulate their wall time per phase."""

    totals: dict[str, float] = field(default_factory=dict)

    def wrap(self, obj: object, attr: str, phase: str) -> Callable:
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - t

        setattr(obj, attr, timed)
        return inner

    def reset(self) -> None:
        self.totals = {}


def measure_step_overhead(
    args, prompt_range: tuple[int, int], batch: int, iters: int
) -> dict[str, Any]:
    """`batch` decode-only requests; per decode position, one timed bare forward and one timed
    engine step of the same batch (order alternating), driven from this thread."""
    from radixlm.runtime.executor import build_forward_batch

    new_tokens = iters + 64  # nobody finishes during warm-up, timing and profiling
    wl = make_workload(batch, args.seed + 1, prompt_range, (new_tokens, new_tokens))
    engine = make_engine(args, pages_for(wl, 16), (max(64, batch), 2048, 512))
    engine.shutdown()  # stop the loop thread: this thread drives the scheduler directly
    sched, runner, proc = engine.scheduler, engine.runner, engine.processor
    core, executor, appender = engine.core, engine.executor, engine.scheduler.appender
    for i, prompt in enumerate(wl.prompts):
        req = Request(request_id=f"s{i}", prompt_token_ids=prompt, params=greedy(new_tokens))
        appender.init_request(req)
        sched.add_request(req)
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        core.step()  # prefill, untimed
    for _ in range(3):
        core.step()  # warm-up decode steps
    timer = PhaseTimer()
    schedule = timer.wrap(sched, "schedule", "schedule")
    bare_forward = timer.wrap(runner, "forward", "forward")
    timer.wrap(executor, "run", "executor_run")
    timer.wrap(executor, "_sample", "sample")
    timer.wrap(sched, "update", "update")
    timer.wrap(appender, "append", "append_detok_stop")
    timer.wrap(proc, "emit", "emit")
    ps = runner.page_size
    step_times, fwd_times = [], []  # (wall, cpu) pairs
    for k in range(iters):
        sb = schedule()  # unwrapped; idempotent for running decodes (pages ensured once)
        fb, _, _ = build_forward_batch(sb, executor.page_table, ps, runner.device)
        assert fb.is_decode_only and fb.batch_size == batch
        for first in ("fwd", "step") if k % 2 == 0 else ("step", "fwd"):
            t = now()
            if first == "fwd":
                bare_forward(fb)
                fwd_times.append(since(t))
            else:
                core.step()
                step_times.append(since(t))
    phases = dict(timer.totals)
    timer.reset()
    seq_lens = [r.num_tokens for r in sched.running]
    profile_text = _profile_steps(core, iters=10) if args.profile else None
    return _overhead_summary(batch, iters, step_times, fwd_times, phases, seq_lens, profile_text)


def _overhead_summary(batch, iters, step_times, fwd_times, phases, seq_lens, profile_text):
    def med(pairs, i):
        return statistics.median(p[i] for p in pairs)

    step_wall, step_cpu = statistics.mean(t[0] for t in step_times), med(step_times, 1)
    per_step = {k: v / iters for k, v in phases.items()}  # only step()'s own calls are wrapped
    # Nesting: executor_run > forward, sample; update > append_detok_stop.
    per_step["executor_other"] = (
        per_step.pop("executor_run", 0.0) - per_step.get("forward", 0.0) - per_step.get("sample", 0)
    )
    per_step["update_other"] = per_step.pop("update", 0.0) - per_step.get("append_detok_stop", 0)
    per_step["step_other"] = step_wall - sum(per_step.values())
    in_step_fwd = per_step["forward"]
    return {
        "batch": batch,
        "iters": iters,
        "seq_len_min_max_at_end": [min(seq_lens), max(seq_lens)],
        "step_ms_median": round(med(step_times, 0) * 1e3, 3),
        "bare_forward_ms_median": round(med(fwd_times, 0) * 1e3, 3),
        "overhead_pct_median": round((med(step_times, 0) / med(fwd_times, 0) - 1) * 100, 2),
        "step_cpu_ms_median": round(step_cpu * 1e3, 3),
        "bare_forward_cpu_ms_median": round(med(fwd_times, 1) * 1e3, 3),
        "overhead_pct_cpu_median": round((step_cpu / med(fwd_times, 1) - 1) * 100, 2),
        # Same step() calls, outside vs inside runner.forward: free of pairing noise.
        "overhead_pct_in_step": round((step_wall - in_step_fwd) / in_step_fwd * 100, 2),
        "phase_ms_mean_per_step": {k: round(v * 1e3, 3) for k, v in per_step.items()},
        "profile_top": profile_text,
    }


def _profile_steps(core, iters: int) -> str:
    """cProfile (Python functions) and torch.profiler (aten ops) over `iters` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        core.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    with profile(activities=[ProfilerActivity.CPU]) as tprof:
        for _ in range(iters):
            core.step()
    ops = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return buf.getvalue() + "\n" + ops


# ---- reporting ----------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]], k: int = 8) -> float:
    """Fraction of requests whose first `k` greedy tokens agree (a sanity check only: bf16 and
    padding change numerics, so greedy paths may diverge)."""
    return sum(x[:k] == y[:k] for x, y in zip(a, b, strict=True)) / max(1, len(a))


def machine_info(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.is_available(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": threads,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "git": _git_state(),
    }


def _git_state() -> str:
    """HEAD commit, plus "+dirty" when the engine sources differ from it."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno", "--", "radixlm"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def print_report(res: dict[str, Any]) -> None:
    hf, best = res.get("hf"), res["radixlm_best"]
    print("\n== throughput: useful output tokens / wall s (and / process CPU s) ==")
    print(f"{'system':<44}{'wall s':>8}{'tok/s':>8}{'CPU s':>8}{'tok/CPU-s':>11}")
    rows = []
    if hf:
        rows.append((f"transformers generate, static batches of {hf['batch_size']}", hf))
    for r in res["radixlm"]:
        name = (
            f"radixlm run={r['max_running_requests']} tokens={r['max_batched_tokens']} "
            f"chunk={r['chunked_prefill_size']}"
        )
        rows.append((name, r))
    for name, r in rows:
        print(
            f"{name:<44}{r['wall_seconds']:>8.1f}{r['output_tok_per_s']:>8.1f}"
            f"{r['cpu_seconds']:>8.1f}{r['output_tok_per_cpu_s']:>11.1f}"
        )
    if hf:
        print(
            f"ratio radixlm(best)/transformers: {res['ratio']:.2f}x wall, "
            f"{res['ratio_cpu']:.2f}x CPU (target >= 4x); HF useful fraction "
            f"{hf['useful_fraction']:.2f}; first-8-token agreement "
            f"{res['greedy_agreement_first8']:.2f}"
        )
    print(
        f"best radixlm: {best['num_steps']} steps ({best['num_decode_only_steps']} decode-only, "
        f"mean batch {best['decode_only_mean_batch']}, {best['decode_only_steps_seconds']:.1f} s; "
        f"with prefill {best['prefill_steps_seconds']:.1f} s), forward "
        f"{best['sum_forward_seconds']:.1f} s of {best['sum_step_seconds']:.1f} s in step(), "
        f"{best['loop_seconds_outside_step']:.2f} s outside; cache hits "
        f"{best['cache_hit_tokens']}, retractions {best['num_retractions']}"
    )
    print("\n== decode-only step() vs bare runner.forward of the same ForwardBatch (medians) ==")
    print(
        f"{'batch':>5}{'step ms':>9}{'fwd ms':>9}{'ovh':>7}{'step CPU':>10}{'fwd CPU':>9}"
        f"{'ovh':>7}{'in-step ovh':>12}  phases (ms/step, mean)"
    )
    for o in res["step_overhead"]:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in o["phase_ms_mean_per_step"].items())
        print(
            f"{o['batch']:>5}{o['step_ms_median']:>9.1f}{o['bare_forward_ms_median']:>9.1f}"
            f"{o['overhead_pct_median']:>6.1f}%{o['step_cpu_ms_median']:>10.1f}"
            f"{o['bare_forward_cpu_ms_median']:>9.1f}{o['overhead_pct_cpu_median']:>6.1f}%"
            f"{o['overhead_pct_in_step']:>11.1f}%  {phases}"
        )
    for o in res["step_overhead"]:
        if o["profile_top"]:
            print(f"\n-- profile of 10 + 10 decode steps, batch {o['batch']} --")
            print(o["profile_top"])


# ---- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="16 short requests, for iterating")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/batching.json"))
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (both sides)")
    p.add_argument("--policy", default="fcfs", help="radixlm schedule policy (no prefix hits here)")
    p.add_argument("--step-batches", default="16,64", help="comma list of decode batch sizes")
    p.add_argument("--step-iters", type=int, default=40)
    p.add_argument(
        "--configs",
        help="radixlm settings to try: RUNNING:BATCHED_TOKENS:CHUNK[,...] (default: built-in)",
    )
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile 10 decode steps")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        prompt_range, output_range = (32, 128), (8, 64)
        configs, iters = QUICK_CONFIGS, min(args.step_iters, 16)
    else:
        prompt_range, output_range = (32, 512), (8, 256)
        configs, iters = ENGINE_CONFIGS, args.step_iters
    if args.configs:
        configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    wl = make_workload(args.num_requests, args.seed, prompt_range, output_range)
    res: dict[str, Any] = {
        "machine": machine_info(args.threads),
        "args": vars(args) | {"out": str(args.out)},
    }
    res["workload"] = wl.summary()
    print(json.dumps(res, indent=1))
    res["radixlm"] = []
    for cfg in configs:
        r = run_radixlm(args, wl, cfg)
        print(f"radixlm {cfg}: {r['output_tok_per_s']} tok/s in {r['wall_seconds']} s", flush=True)
        res["radixlm"].append(r)
    best = max(res["radixlm"], key=lambda r: r["output_tok_per_s"])
    res["radixlm_best"] = {k: v for k, v in best.items() if not k.startswith("_")}
    if not args.skip_hf:
        res["hf"] = run_hf(_model_dir(), getattr(torch, args.dtype), wl, HF_BATCH_SIZE)
        print(
            f"transformers: {res['hf']['output_tok_per_s']} tok/s in {res['hf']['wall_seconds']} s"
        )
        res["ratio"] = round(best["output_tok_per_s"] / res["hf"]["output_tok_per_s"], 3)
        res["ratio_cpu"] = round(
            best["output_tok_per_cpu_s"] / res["hf"]["output_tok_per_cpu_s"], 3
        )
        res["greedy_agreement_first8"] = agreement(best["_outputs"], res["hf"]["_outputs"])
    res["step_overhead"] = [
        measure_step_overhead(args, prompt_range, int(b), iters)
        for b in args.step_batches.split(",")
    ]
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print_report(res)
    _write(res, args.out)


def _model_dir() -> Path:
    from radixlm.runtime.models.loader import resolve_model_path

    return resolve_model_path(None)


def _write(res: dict[str, Any], out: Path) -> None:
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.startswith("_")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(strip(res), indent=1) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
