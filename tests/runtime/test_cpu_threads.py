"""The forward's CPU threads (`radixlm.runtime.cpu_threads`): the affinity mask, the pinned
OpenMP team of the calling thread, and releasing idle teams."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from radixlm.kernels.cpu import build
from radixlm.runtime import cpu_threads

if build.load_op() is None:
    pytest.skip(f"CPU ops unavailable: {build.load_error()}", allow_module_level=True)


def in_thread(fn):
    """Run `fn` on a fresh thread (its own OpenMP team; the test thread is left alone)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


def test_affinity_cpus_is_the_process_mask() -> None:
    cpus = cpu_threads.affinity_cpus()
    assert cpus and cpus == sorted(os.sched_getaffinity(0))


def test_one_thread_is_not_pinned() -> None:
    def body():
        pinned = cpu_threads.pin_forward_threads(1)
        return pinned, torch.get_num_threads(), os.sched_getaffinity(0)

    pinned, n, mask = in_thread(body)
    assert pinned == [] and n == 1 and mask == set(os.sched_getaffinity(0))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_team_is_pinned_one_thread_per_cpu() -> None:
    cpus = cpu_threads.affinity_cpus()[:2]

    def body():
        pinned = cpu_threads.pin_forward_threads(2)
        x = torch.randn(256, 256)
        y = x @ x  # a parallel region on the pinned team still computes
        return pinned, torch.get_num_threads(), os.sched_getaffinity(0), y.shape

    pinned, n, mask, shape = in_thread(body)
    assert pinned == cpus and n == 2
    assert mask == {cpus[0]}  # the calling thread is thread 0 of its team
    assert shape == (256, 256)


def test_more_threads_than_cpus_are_left_unpinned() -> None:
    n = len(cpu_threads.affinity_cpus()) + 1
    assert in_thread(lambda: cpu_threads.pin_forward_threads(n)) == []


def test_release_idle_teams() -> None:
    assert cpu_threads.release_idle_teams()
    assert torch.ones(4).sum().item() == 4  # torch keeps working: teams come back on use
