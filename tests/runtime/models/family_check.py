"""Shared checks of a model family against transformers on a tiny random-weight model (float32):
logits of every position through the paged cache in chunks, and greedy tokens through the
engine (chunked prefill, prefix-cache hits, concurrent requests) against `generate`."""

from __future__ import annotations

from pathlib import Path

import torch

from radixlm import Engine, SamplingParams
from radixlm.config import CacheConfig
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.radix import HybridBlockPool
from radixlm.runtime.model_runner import ModelRunner

SHARED = [(i * 7919) % 40000 + 5 for i in range(21)]  # a prefix two prompts share
PROMPTS = [
    SHARED + [101, 102, 103],
    SHARED + [104, 105],  # a prefix-cache hit on SHARED's full pages
    [(i * 31) % 30000 + 7 for i in range(45)],  # several prefill chunks
    [5, 6, 7],
]
NEW_TOKENS = 12


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([ids])).logits[0]


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model = hf_model(model_dir)
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(ids[0, len(p) :].tolist())
    return out


def run_chunks(runner: ModelRunner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Prefill `ids` in the given chunk sizes through the paged cache; all-position logits.

    With a hybrid pool (sliding-window layers), pages come from a `HybridBlockPool` chunk by
    chunk, and after each chunk the window pages no later query sees are released (their
    window layers' reads then land on the zero scratch page)."""
    ps = runner.page_size
    pool = None
    if runner.num_swa_pages is not None:
        pool = HybridBlockPool(runner.num_pages, runner.num_swa_pages, ps, runner.swa_window)
        runner.bind_swa_map(pool.swa_map)
    pages: list[int] = []
    outs, start, released = [], 0, 0
    for n in chunks:
        need = -(-(start + n) // ps)
        pages += pool.alloc(need - len(pages)) if pool else range(len(pages), need)
        batch = ForwardBatch.build(
            [ids[start : start + n]], [start], [pages], [list(range(n))], ps, "cpu"
        )
        outs.append(runner.forward(batch))
        start += n
        if pool is not None:
            first = pool.first_needed_page(start)
            pool.decref_swa(pages[released:first])
            released = first
    return torch.cat(outs)


def assert_logits_match(
    model_dir: Path, ids: list[int], chunks: list[int], backend: str = "torch"
) -> ModelRunner:
    runner = ModelRunner(
        model_dir,
        "float32",
        torch.device("cpu"),
        CacheConfig(page_size=4, num_pages=-(-len(ids) // 4) + 2, swa_full_tokens_ratio=1.0),
        attention_backend=backend,
        hybrid_swa=True,
    )
    ours = run_chunks(runner, ids, chunks)
    torch.testing.assert_close(ours, hf_logits(model_dir, ids), atol=2e-4, rtol=1e-4)
    return runner


def engine_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int, **kw):
    """Greedy tokens of `prompts` through the engine: the first two one after the other (the
    second hits the first's cached prefix), the rest as one concurrent batch."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine_kw = dict(
        dtype="float32", page_size=4, num_pages=128, chunked_prefill_size=8, num_threads=1
    )
    with Engine(str(model_dir), **{**engine_kw, **kw}) as engine:
        out = [engine.generate(p, params).outputs[0].output_token_ids for p in prompts[:2]]
        out += [r.outputs[0].output_token_ids for r in engine.generate(prompts[2:], params)]
        stats = engine.stats()
        engine.check_integrity()
    return out, stats


def assert_engine_matches_generate(
    model_dir: Path, prompts: list[list[int]] = PROMPTS, new_tokens: int = NEW_TOKENS, **kw
) -> None:
    ours, stats = engine_greedy(model_dir, prompts, new_tokens, **kw)
    assert stats.cache_hit_tokens > 0
    assert ours == hf_greedy(model_dir, prompts, new_tokens)
