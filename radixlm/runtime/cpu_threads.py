"""The forward's CPU threads: one OpenMP team, on the engine's loop thread, pinned.

torch's intra-op parallelism (and oneDNN's) runs on the OpenMP team of the OS thread that calls
it, and every thread that ever ran a parallel op keeps a team. libgomp counts the threads of all
teams; once they outnumber the CPUs it throttles its spin-wait, and every parallel region of the
forward then pays a sleep/wake of its workers. Measured (SmolLM2 batch-1 decode, 2 threads, AVX512
EPYC): 16-17 ms on the main thread, 23 ms on the loop thread while the main thread's team (left by
loading the model) exists, 16 ms once that team is released. So the engine releases the idle
teams after loading and runs every forward on one team, its threads pinned one per CPU of the
process's affinity (as vLLM's CPU worker binds its OpenMP threads).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def affinity_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _op():
    from radixlm.kernels.cpu.build import load_op

    return load_op()


def release_idle_teams() -> bool:
    """Free the OpenMP thread pools of all threads (they are recreated on next use)."""
    op = _op()
    return op is not None and int(op.release_thread_pools()) == 0


def pin_forward_threads(num_threads: int) -> list[int]:
    """On the calling thread: `num_threads` intra-op threads, pinned to the first CPUs of the
    affinity mask when there are at least that many (else left unpinned). One thread is not
    pinned (no team to keep together; several single-threaded engines in one process would
    otherwise share one CPU). Returns the CPUs pinned to ([] when none)."""
    torch.set_num_threads(num_threads)
    cpus = affinity_cpus()
    op = _op()
    if op is None or num_threads < 2 or num_threads > len(cpus):
        return []
    chosen = cpus[:num_threads]
    pinned = int(op.pin_threads(chosen))
    if pinned != num_threads:
        logger.warning("pinned %d of %d forward threads", pinned, num_threads)
    return chosen[:pinned]
