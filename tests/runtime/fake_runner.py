"""A fake model runner whose next token depends on the whole context *as read back from the
paged KV cache*, so scheduling bugs (wrong page tables, lost prefix, bad copy-on-write) change the
output. K slot value = token id + 1 (0 means never written)."""

from __future__ import annotations

import torch

from radixlm.kernels.forward_batch import ForwardBatch, KVCache
from radixlm.runtime.grammar.bitmask import apply_token_bitmask

VOCAB = 64
EOS = 2


def reference_next(context: list[int]) -> int:
    """The token the fake model emits after `context` (never EOS or the other low ids)."""
    return (sum(context) * 31 + len(context)) % (VOCAB - 3) + 3


def reference_continuation(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(reference_next(ctx))
    return ctx[len(prompt) :]


def with_masks(logits: torch.Tensor, logits_mask) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """What an LM head that takes masks returns (``Model.forward``'s ``logits_mask``)."""
    masks = None if logits_mask is None else logits_mask(logits.shape[0])
    if masks is not None:
        apply_token_bitmask(logits, *masks)
    return logits


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.device = torch.device("cpu")
        self.page_size = page_size
        self.num_pages = num_pages
        self.vocab_size = VOCAB
        self.kv_cache = KVCache.allocate(1, num_pages, page_size, 1, 1, torch.float32, "cpu")
        self.batches: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch, logits_mask=None) -> torch.Tensor:  # [R, V]
        """``ModelRunner.forward``; with ``logits_mask`` (the grammar's masks) an LM head that
        takes masks (``Model.forward``)."""
        self.batches.append(batch)
        k = self.kv_cache.k_buffers[0]
        k[batch.out_cache_loc, 0, 0] = batch.input_ids.float() + 1
        rows = batch.logits_indices.tolist()
        logits = torch.zeros(len(rows), VOCAB)
        indptr = batch.qo_indptr.tolist()
        for r, row in enumerate(rows):
            i = next(j for j in range(batch.batch_size) if indptr[j] <= row < indptr[j + 1])
            seq_len = int(batch.prefix_lens[i]) + (row - indptr[i]) + 1
            pages = batch.page_table[i].tolist()
            slots = [
                pages[p // self.page_size] * self.page_size + p % self.page_size
                for p in range(seq_len)
            ]
            vals = k[slots, 0, 0]
            assert bool((vals > 0).all()), f"request {i}: context slot never written"
            logits[r] = self.next_logits([int(v) - 1 for v in vals])
        return with_masks(logits, logits_mask)

    def next_logits(self, context: list[int]) -> torch.Tensor:  # [V]
        """The logits after `context` (read back from the pages): `reference_next` wins."""
        row = torch.zeros(VOCAB)
        row[reference_next(context)] = 10.0
        return row


class FixedLogits:
    """Every logits row is the same small distribution (a 'model' for sampling statistics)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.row = logits  # [V]
        self.device = torch.device("cpu")
        self.vocab_size = logits.numel()
        self.page_size = 4

    def forward(self, batch, logits_mask=None):  # type: ignore[no-untyped-def]
        logits = self.row.expand(len(batch.logits_indices), -1).clone()  # [R, V]
        return with_masks(logits, logits_mask)


def attach_core(scheduler, runner: FakeRunner, grammar=None):
    """Give a test scheduler a `step()` (the engine's four-line step over an `Executor` on the
    fake runner) and a `runner` attribute; returns the scheduler."""
    from radixlm.runtime.engine_core import EngineCore
    from radixlm.runtime.executor import Executor
    from radixlm.runtime.output_processor import OutputProcessor

    executor = Executor(runner, [EOS], seed=0)
    if grammar is not None:
        executor.set_grammar(grammar)
    processor = OutputProcessor()
    core = EngineCore(scheduler, executor, processor)
    scheduler.processor = processor
    scheduler.runner = runner
    scheduler.executor = executor
    scheduler.step = core.step
    return scheduler
