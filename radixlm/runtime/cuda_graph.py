"""CUDA graphs for decode-shaped forwards: one graph per row-count bucket, captured at start.

A decode step of a large model on a GPU launches ~10 kernels per layer; at small batch their
launch cost (host time) exceeds their run time. `DecodeGraphs` captures the whole forward once per
bucket (`decode_buckets`: 1, 2, 4, 8, then every 8 up to `max_bs` rows) and replays it: one launch
per step. vLLM and SGLang do the same (their `--cuda-graph-max-bs`, `--disable-cuda-graph`).

**Short extends replay too** (a speculative verification: k + 1 new tokens per request; a
prompt of a few tokens): every new token becomes a decode row of its own, over its request's
page-table row, with `seq_len = position + 1`. Each layer stores all the rows' K/V before the
attention runs, so row j of a request reads the cached prefix and its own draft tokens 0..j:
the extend's causal attention, computed by the decode kernel. A forward of `T` tokens replays
the bucket of `T` rows (a row reads its whole context, so `T` rows read the request's K/V up to
`k + 1` times: small next to the eager forward's launches, which a verification otherwise pays
at every step; SGLang captures its verify steps for the same reason).

How a forward becomes replayable:

- **Static inputs.** Every tensor the captured kernels read lives in `StaticInputs`, allocated
  once for the largest bucket; a step copies its batch's device tensors into the first `B` rows
  and replays the smallest bucket >= `B`. The page table has a column for every page of the
  longest context, so no step needs a wider one.
- **Padding rows** (`B` <= row < bucket) write their K/V into the runner's scratch page (a page
  past the pool's: `ModelRunner.scratch_page`, never allocated to a request) and read one key
  (`seq_lens = 1`); their logits are never returned. A real page is never written by them.
- **A plan from device tensors only.** The attention backend must read lengths from the
  batch's device tensors inside its kernels (`TritonAttentionBackend`); the capture batch's host
  lists claim the longest context (`max_model_len`), so the split-KV factor frozen into a
  graph suits every length it serves (the kernels split each row by its own length).
- **Outputs** live in the graphs' shared memory pool; `run` returns the requested rows
  gathered into a fresh tensor, so nothing a caller holds is overwritten by the next replay.

`capture` is pluggable: `cuda_capture` (the real thing) or `eager_capture` (re-runs the forward
on the static inputs: CPU tests of the plumbing, with Triton's interpreter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixlm.kernels.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

Replay = Callable[[], None]

# The most rows a graph gets for speculative verifications (k + 1 rows a request): bounds the
# capture time and the graphs' memory (the largest bucket's activations and logits).
SPEC_GRAPH_MAX_ROWS = 256


class GraphCapture(Protocol):
    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        """Capture `run` (warmed up first); return its replay and its output tensor, which
        every replay overwrites in place."""
        ...


def cuda_capture(pool: Any = None, warmup: int = 2) -> GraphCapture:
    """Real CUDA graphs sharing one memory pool (buckets captured largest first, so the smaller
    ones reuse its blocks; only one graph runs at a time)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        # NOTE: warm up on a side stream (Triton compiles, cuBLAS picks its kernels) so that
        # nothing lazy happens inside the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run()
        return graph.replay, out

    return capture


def eager_capture(run: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """A stand-in that replays by running the forward again on the same static inputs."""
    out = run()

    def replay() -> None:
        with torch.inference_mode():  # NOTE: `out` is an inference tensor (the model's)
            out.copy_(run())

    return replay, out


def decode_buckets(max_bs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then multiples of 8, and `max_bs` itself."""
    if max_bs < 1:
        return []
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    out += list(range(16, max_bs + 1, 8))
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


@dataclass
class StaticInputs:
    """The tensors every graph reads, sized for the largest bucket `M`."""

    input_ids: torch.Tensor  # [M] int64
    positions: torch.Tensor  # [M] int64
    out_cache_loc: torch.Tensor  # [M] int64; padding rows: the scratch page's first slot
    seq_lens: torch.Tensor  # [M] int32; padding rows: 1
    prefix_lens: torch.Tensor  # [M] int32
    extend_lens: torch.Tensor  # [M] int32, all 1
    qo_indptr: torch.Tensor  # [M + 1] int32, arange
    page_table: torch.Tensor  # [M, max_pages] int32; a column per page of the longest context
    logits_indices: torch.Tensor  # [M] int64, arange

    @classmethod
    def allocate(
        cls, m: int, max_pages: int, scratch_page: int, page_size: int, device: torch.device
    ) -> StaticInputs:
        def i32(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int32, device=device)

        return cls(
            input_ids=torch.zeros(m, dtype=torch.int64, device=device),
            positions=torch.zeros(m, dtype=torch.int64, device=device),
            out_cache_loc=torch.full((m,), scratch_page * page_size, dtype=torch.int64,
                                     device=device),
            seq_lens=i32(m, fill=1),
            prefix_lens=i32(m),
            extend_lens=i32(m, fill=1),
            qo_indptr=torch.arange(m + 1, dtype=torch.int32, device=device),
            page_table=i32(m, max_pages, fill=scratch_page),
            logits_indices=torch.arange(m, dtype=torch.int64, device=device),
        )  # fmt: skip

    def batch(self, b: int, page_size: int, max_model_len: int) -> ForwardBatch:
        """The capture batch of bucket `b`: views of the first `b` rows. Its host lists claim
        the longest context (the split-KV plan is made for it)."""
        return ForwardBatch(
            input_ids=self.input_ids[:b],
            positions=self.positions[:b],
            out_cache_loc=self.out_cache_loc[:b],
            seq_lens=self.seq_lens[:b],
            prefix_lens=self.prefix_lens[:b],
            extend_lens=self.extend_lens[:b],
            qo_indptr=self.qo_indptr[: b + 1],
            page_table=self.page_table[:b],
            logits_indices=self.logits_indices[:b],
            page_size=page_size,
            seq_lens_cpu=[max_model_len] * b,
            extend_lens_cpu=[1] * b,
        )


class DecodeGraphs:
    """One captured decode forward per bucket of `decode_buckets(max_bs)` rows; it serves a
    decode batch of up to `max_bs` requests, or any forward of up to `max_bs` tokens.

    Invariants: the static inputs are written only by `run`, right before a replay; the
    padding rows of a replay write only the scratch page; `forward(batch, attn)` of `model`
    is the eager forward the graphs were captured from.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn: Any,
        page_size: int,
        max_model_len: int,
        scratch_page: int,
        max_bs: int,
        device: torch.device,
        capture: GraphCapture | None = None,
    ) -> None:
        self.model = model
        self.attn = attn
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.scratch_page = scratch_page
        self.buckets = decode_buckets(max_bs)
        self.max_bs = self.buckets[-1] if self.buckets else 0
        self.max_pages = -(-max_model_len // page_size)
        self.static = StaticInputs.allocate(
            max(1, self.max_bs), self.max_pages, scratch_page, page_size, device
        )
        self._requests = torch.arange(max(1, self.max_bs), device=device)  # [M] int64
        self._capture = capture
        self.graphs: dict[int, tuple[Replay, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0
        self.extend_replays = 0  # the replays that served short extends (verifications)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (the later ones reuse the pool's blocks)."""
        capture = self._capture or cuda_capture()
        start = time.perf_counter()
        for b in sorted(self.buckets, reverse=True):
            fb = self.static.batch(b, self.page_size, self.max_model_len)

            def run(fb: ForwardBatch = fb) -> torch.Tensor:
                self.attn.init_forward(fb)
                return self.model(fb, self.attn)

            self.graphs[b] = capture(run)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The bucket that serves `batch` (by its token count: an extend's tokens become decode
        rows), or None (no tokens, too many, a page table wider than the graphs')."""
        t = batch.num_tokens
        if t == 0 or t > self.max_bs:
            return None
        if batch.page_table.shape[1] > self.max_pages:
            return None
        return next(x for x in self.buckets if x >= t)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:  # [R, V] float32, or None
        """Replay the graph of `batch`'s bucket and return the logits of its
        `logits_indices`; None when no graph serves it (the caller runs it eagerly)."""
        bucket = self.bucket_for(batch)
        if bucket is None:
            return None
        t = batch.num_tokens
        s = self.static
        s.input_ids[:t].copy_(batch.input_ids)
        s.positions[:t].copy_(batch.positions)
        s.out_cache_loc[:t].copy_(batch.out_cache_loc)
        width = batch.page_table.shape[1]
        if batch.is_decode_only:
            s.seq_lens[:t].copy_(batch.seq_lens)
            s.prefix_lens[:t].copy_(batch.prefix_lens)
            s.page_table[:t, :width].copy_(batch.page_table)
        else:  # one decode row per new token (module docstring); no host sync
            owner = torch.repeat_interleave(
                self._requests[: batch.batch_size], batch.extend_lens, output_size=t
            )  # [T] request of each token
            s.seq_lens[:t].copy_(batch.positions + 1)
            s.prefix_lens[:t].copy_(batch.positions)
            s.page_table[:t, :width].copy_(batch.page_table.index_select(0, owner))
            self.extend_replays += 1
        if bucket > t:
            # NOTE: padding rows keep stale (valid) ids, positions and page ids: they read one
            # key anywhere and write only the scratch page.
            s.out_cache_loc[t:bucket].fill_(self.scratch_page * self.page_size)
            s.seq_lens[t:bucket].fill_(1)
        replay, out = self.graphs[bucket]
        replay()
        self.replays += 1
        return out.index_select(0, batch.logits_indices)
