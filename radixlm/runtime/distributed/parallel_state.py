"""Tensor-parallel process groups over `torch.distributed`.

Two groups per engine, both spanning all `tp_size` ranks:

- `device_group`: the activations' all-reduces (NCCL on CUDA, gloo on CPU), with a bounded
  timeout so that a rank that stops answering mid-forward turns into an error, not a hang.
- `cpu_group`: gloo, for control traffic (the step broadcast from rank 0). Workers wait on it
  between steps for as long as the engine is idle, so its timeout is long; a rank that dies
  closes its sockets and the waiting peers fail at once rather than at the timeout.

Ranks are numbered node-major: node `n` of `nnodes` runs ranks `n * per_node ...`. Rank 0 (on
node 0) runs the scheduler.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 120.0  # one all-reduce waits at most this long for the slowest rank
IDLE_TIMEOUT_S = 365 * 24 * 3600.0  # workers wait this long for the next step


@dataclass(frozen=True)
class DistributedConfig:
    """Where rank 0's rendezvous listens and which ranks this node runs."""

    tp_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (one node only)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("several nodes need an explicit MASTER_PORT / --dist-init-addr")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @classmethod
    def from_env(
        cls, tp_size: int, nnodes: int = 1, node_rank: int = 0, init_addr: str | None = None
    ) -> DistributedConfig:
        """`init_addr` ("host:port"), else MASTER_ADDR / MASTER_PORT, else loopback and a free
        port."""
        if init_addr:
            host, _, port = init_addr.rpartition(":")
            return cls(tp_size, nnodes, node_rank, host, int(port))
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "0"))
        if not port and nnodes == 1:
            port = free_port(addr)
        return cls(tp_size, nnodes, node_rank, addr, port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class TensorParallelGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    device_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (a control-group collective: all ranks call)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (identity for one rank)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x


def init_tensor_parallel(
    config: DistributedConfig,
    rank: int,
    device: torch.device,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> TensorParallelGroup:
    """Join the rendezvous at `config.init_method` as `rank` and build both groups."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method=config.init_method,
        world_size=config.tp_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    ranks = list(range(config.tp_size))
    device_group = dist.new_group(
        ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s)
    )
    cpu_group = dist.new_group(
        ranks, backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S)
    )
    return TensorParallelGroup(rank, config.tp_size, device_group, cpu_group)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
