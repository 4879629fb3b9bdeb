"""Tensor parallel execution: rank 0 schedules, every rank runs the same forward on its shard.

`TensorParallelRunner` stands where a `ModelRunner` stands (the engine calls `forward(batch)`
and `kv_cache.copy_pages(src, dst)`, and reads `num_pages`, `vocab_size`, ...). It starts ranks
`1..tp-1` of this node with `torch.multiprocessing` (spawn), holds rank 0's shard itself, and
before each operation broadcasts it to the other ranks over the gloo control group:

    header  int64[8]  (op, T, B, max_pages, R, page_size, 0, 0)
    payload int64[n]  input_ids | positions | out_cache_loc | seq_lens | prefix_lens |
                      extend_lens | qo_indptr | page_table (B x max_pages) | logits_indices

The second KV tier's ops (`tier_ops.py`: each rank stores and loads its own shard of a page)
travel the same way, in order with the forwards.

Why a gloo broadcast of one compact tensor rather than shared memory: it is the same code on one
node and on several (`--nnodes`), the payload is a few KB (token ids and page ids, never
activations), and the all-reduces inside the forward already synchronize the ranks, so nothing
else is needed; shared memory would work only on one node and need its own signalling.

Failure: a rank that dies closes its sockets, so the peers' next collective fails at once (and a
rank that hangs fails them after `COLLECTIVE_TIMEOUT_S`); rank 0 also watches its local worker
processes. Either way the runner marks itself failed, every later `forward` raises
`TensorParallelError` naming the rank, and `on_failure` (set by the server) is called once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixlm.config import CacheConfig
from radixlm.kernels.forward_batch import ForwardBatch
from radixlm.runtime.distributed.parallel_state import (
    DistributedConfig,
    TensorParallelGroup,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from radixlm.runtime.distributed.tier_ops import TIER_OPS, BroadcastTierFollowers, WorkerTier
from radixlm.runtime.models.base import LogitsMask

logger = logging.getLogger(__name__)

OP_FORWARD = 1
OP_COPY_PAGES = 2
OP_SHUTDOWN = 3
HEADER_LEN = 8
STARTUP_TIMEOUT_S = 600.0


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died or stopped answering)."""


# ---- the step encoding ---------------------------------------------------------------------------


def encode_forward(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [8], payload [n]) int64 CPU tensors describing `batch`."""
    table = batch.page_table
    header = torch.tensor(
        [
            OP_FORWARD,
            batch.num_tokens,
            batch.batch_size,
            table.shape[1],
            batch.logits_indices.shape[0],
            batch.page_size,
            0,
            0,
        ],
        dtype=torch.int64,
    )
    parts = [
        batch.input_ids,
        batch.positions,
        batch.out_cache_loc,
        batch.seq_lens,
        batch.prefix_lens,
        batch.extend_lens,
        batch.qo_indptr,
        table.reshape(-1),
        batch.logits_indices,
    ]
    payload = torch.cat([p.to("cpu", torch.int64) for p in parts])
    return header, payload


def decode_forward(
    header: torch.Tensor, payload: torch.Tensor, device: torch.device
) -> ForwardBatch:
    _, t, b, max_pages, r, page_size = (int(x) for x in header[:6])
    sizes = [t, t, t, b, b, b, b + 1, b * max_pages, r]
    (ids, pos, slots, seq, prefix, extend, indptr, table, rows) = payload.split(sizes)
    i32 = torch.int32
    return ForwardBatch(
        input_ids=ids.to(device),
        positions=pos.to(device),
        out_cache_loc=slots.to(device),
        seq_lens=seq.to(device, i32),
        prefix_lens=prefix.to(device, i32),
        extend_lens=extend.to(device, i32),
        qo_indptr=indptr.to(device, i32),
        page_table=table.reshape(b, max_pages).to(device, i32),
        logits_indices=rows.to(device),
        page_size=page_size,
        seq_lens_cpu=seq.tolist(),
        extend_lens_cpu=extend.tolist(),
    )


def _header(op: int, *values: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = op
    h[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


# ---- the other ranks -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkerArgs:
    """Everything a rank needs to build its shard (picklable: it crosses `spawn`)."""

    model_dir: Path
    dtype: str
    device: str
    cache_config: CacheConfig
    attention_backend: str
    max_model_len: int | None
    dist_config: DistributedConfig
    num_threads: int | None
    quantization: str = "none"
    quantization_group_size: int = 32
    quantization_lm_head: str = "int8"


def _die_with_parent() -> None:
    """Linux: SIGTERM this rank if the process that started it dies (no orphaned ranks)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _build_runner(args: WorkerArgs, group: TensorParallelGroup) -> Any:
    from radixlm.runtime.model_runner import ModelRunner

    return ModelRunner(
        args.model_dir,
        args.dtype,
        torch.device(args.device),
        args.cache_config,
        args.attention_backend,
        args.max_model_len,
        tp=group,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantization_lm_head=args.quantization_lm_head,
    )


def _worker_device(args: WorkerArgs, rank: int) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def worker_main(rank: int, args: WorkerArgs) -> None:
    """Entry of rank `rank` (> 0): build the shard, then run every broadcast step until
    shutdown. Any error is logged and ends the process with status 1 (the peers then fail)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    _die_with_parent()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = _worker_device(args, rank)
    try:
        group = init_tensor_parallel(args.dist_config, rank, device)
        runner = _build_runner(dataclasses.replace(args, device=str(device)), group)
        _serve_steps(runner, group, device, WorkerTier(rank, args.model_dir))
    except Exception:  # noqa: BLE001 - reported, then the process exits non-zero
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        destroy_tensor_parallel()


def _serve_steps(
    runner: Any, group: TensorParallelGroup, device: torch.device, tier: WorkerTier
) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=group.cpu_group)
        op = int(header[0])
        if op == OP_SHUTDOWN:
            tier.close()  # this rank's pending tier writes
            return
        payload = torch.empty(int(header[7]), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, src=0, group=group.cpu_group)
        if op == OP_FORWARD:
            batch = decode_forward(header, payload, device)
            runner.forward(batch)  # logits discarded: rank 0 samples
        elif op == OP_COPY_PAGES:
            src, dst = payload.split(int(header[1]))
            runner.kv_cache.copy_pages(src.tolist(), dst.tolist())
        elif op in TIER_OPS:
            tier.serve(op, int(header[1]), payload, runner.kv_cache, group.cpu_group)
        else:
            raise TensorParallelError(f"unknown step op {op}")


# ---- rank 0 --------------------------------------------------------------------------------------


class _BroadcastKVCache:
    """Rank 0's KV cache: page copies are replayed on every rank."""

    def __init__(self, owner: TensorParallelRunner) -> None:
        self._owner = owner
        self._local = owner.local.kv_cache

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        if src:
            payload = torch.tensor([*src, *dst], dtype=torch.int64)
            self._owner._send(_header(OP_COPY_PAGES, len(src)), payload)
        self._local.copy_pages(src, dst)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)


class TensorParallelRunner:
    """Rank 0: a `ModelRunner` look-alike that runs every operation on all ranks."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        device: torch.device,
        cache_config: CacheConfig,
        attention_backend: str,
        max_model_len: int | None,
        dist_config: DistributedConfig,
        num_threads: int | None = None,
        quantization: str = "none",
        quantization_group_size: int = 32,
        quantization_lm_head: str = "int8",
    ) -> None:
        self.dist_config = dist_config
        self.failed: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._lock = threading.Lock()  # one step broadcast at a time
        self._fail_lock = threading.Lock()
        self._closed = threading.Event()
        args = WorkerArgs(
            Path(model_dir),
            dtype,
            str(device),
            cache_config,
            attention_backend,
            max_model_len,
            dist_config,
            num_threads,
            quantization,
            quantization_group_size,
            quantization_lm_head,
        )
        from transformers import AutoConfig

        from radixlm.runtime.distributed.sharding import shard_spec

        # Refuse an impossible split before starting any process.
        shard_spec(AutoConfig.from_pretrained(model_dir, local_files_only=True), self.tp_size, 0)
        ctx = mp.get_context("spawn")
        self.workers: list[Any] = []
        for rank in dist_config.local_ranks:
            if rank == 0:
                continue
            p = ctx.Process(target=worker_main, args=(rank, args), name=f"radixlm-tp{rank}")
            p.daemon = True
            p.start()
            self.workers.append(p)
        try:
            self.group = init_tensor_parallel(dist_config, 0, device)
            self.local = _build_runner(args, self.group)
        except Exception:
            self._kill_workers()
            destroy_tensor_parallel()
            raise
        self.kv_cache = _BroadcastKVCache(self)
        self._watchdog = threading.Thread(target=self._watch, name="radixlm-tp-watch", daemon=True)
        self._watchdog.start()

    def __getattr__(self, name: str) -> Any:
        # device, dtype, num_pages, page_size, vocab_size, max_model_len, model, attn, ...
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def tp_size(self) -> int:
        return self.dist_config.tp_size

    # ---- operations ----------------------------------------------------------------------------

    def forward(
        self, batch: ForwardBatch, logits_mask: LogitsMask | None = None
    ) -> torch.Tensor:  # [R, V] float32
        if self.failed:
            raise TensorParallelError(self.failed)
        self._send(*encode_forward(batch))
        try:
            return self.local.forward(batch, logits_mask)
        except Exception as exc:  # a collective failed: a peer is gone
            raise self._fail(f"forward failed: {exc}") from exc

    def open_tier(self, spec: Any) -> BroadcastTierFollowers:
        """Ranks 1..N-1 open their shards of the second KV tier (``TierSpec``); the result
        sends rank 0's tier decisions to them."""
        return BroadcastTierFollowers(self, spec)

    def send_op(
        self, op: int, n: int, payload: torch.Tensor | None, reply: int | None = None
    ) -> int:
        """Run one op on every other rank (``header[1] = n``). With ``reply``, every rank
        answers an int (rank 0 ``reply``) and the minimum over all ranks is returned."""
        if reply is None:
            self._send(_header(op, n), payload)
            return 0
        answer = torch.tensor([reply], dtype=torch.int64)
        self._send(_header(op, n), payload, answer)
        return int(answer[0])

    def _send(
        self,
        header: torch.Tensor,
        payload: torch.Tensor | None,
        reply: torch.Tensor | None = None,
    ) -> None:
        """Broadcast one step (the header, then the payload unless it is None or empty); with
        ``reply``, then all-reduce it (MIN) as the ranks' answer."""
        with self._lock:
            if self.failed:
                raise TensorParallelError(self.failed)
            header[7] = 0 if payload is None else payload.numel()
            try:
                dist.broadcast(header, src=0, group=self.group.cpu_group)
                if payload is not None and payload.numel():
                    dist.broadcast(payload, src=0, group=self.group.cpu_group)
                if reply is not None:
                    dist.all_reduce(reply, op=dist.ReduceOp.MIN, group=self.group.cpu_group)
            except Exception as exc:
                raise self._fail(f"step broadcast failed: {exc}") from exc

    # ---- failure and shutdown ------------------------------------------------------------------

    def _fail(self, reason: str) -> TensorParallelError:
        from multiprocessing.connection import wait

        # A peer's sockets close a moment before its process has exited: give it 2 s. A closed
        # sentinel means the process is gone even before it is reaped (exit code still None).
        ranked = self._ranked()
        gone = set(wait([p.sentinel for _, p in ranked], timeout=2.0)) if ranked else set()
        dead = [
            f"rank {r} (exit {p.exitcode})" if p.exitcode is not None else f"rank {r} (exited)"
            for r, p in ranked
            if p.sentinel in gone
        ]
        message = f"tensor parallel group broken: {', '.join(dead) or reason}"
        first = False
        with self._fail_lock:
            if self.failed is None:
                self.failed, first = message, True
        if first:
            logger.error("%s (%s)", message, reason)
            if self.on_failure is not None:
                self.on_failure(message)
        return TensorParallelError(message)

    def _ranked(self) -> list[tuple[int, Any]]:
        ranks = [r for r in self.dist_config.local_ranks if r != 0]
        return list(zip(ranks, self.workers))

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        while not self._closed.is_set():
            sentinels = [p.sentinel for p in self.workers if p.is_alive()]
            if len(sentinels) < len(self.workers):
                self._fail("a worker process exited")
                return
            if not sentinels:
                return
            wait(sentinels, timeout=1.0)

    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if not self.failed:
            try:
                self._send(_header(OP_SHUTDOWN), None)
            except TensorParallelError:
                pass
        for p in self.workers:
            p.join(timeout=30)
        self._kill_workers()
        destroy_tensor_parallel()

    def _kill_workers(self) -> None:
        for p in self.workers:
            if p.is_alive():
                p.kill()
                p.join()


def run_worker_node(engine_kwargs: dict[str, Any]) -> int:
    """Node `node_rank > 0` of a multi-node group: run this node's ranks (no scheduler, no
    server) until rank 0 shuts them down; the exit status is 1 if any rank failed."""
    from radixlm.config import EngineConfig
    from radixlm.runtime.model_runner import pick_device
    from radixlm.runtime.models.loader import resolve_model_path

    cfg = EngineConfig.from_kwargs(**engine_kwargs)
    dist_config = DistributedConfig.from_env(
        cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr
    )
    args = WorkerArgs(
        resolve_model_path(cfg.model),
        cfg.dtype,
        str(pick_device(cfg.device)),
        cfg.cache,
        cfg.attention_backend,
        cfg.scheduler.max_model_len,
        dist_config,
        cfg.num_threads,
        cfg.quantization,
        cfg.quantization_group_size,
        cfg.quantization_lm_head,
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=worker_main, args=(rank, args), name=f"radixlm-tp{rank}")
        for rank in dist_config.local_ranks
    ]
    for p in procs:
        p.start()
    logger.info(
        "node %d: ranks %s joined %s",
        cfg.node_rank,
        list(dist_config.local_ranks),
        dist_config.init_method,
    )
    for p in procs:
        p.join()
    return 0 if all(p.exitcode == 0 for p in procs) else 1
