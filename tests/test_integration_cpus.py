"""mergekit_ram.integration.cpus: the CPUs this process may use."""

from __future__ import annotations

import pytest
import torch

from mergekit_ram.core.parallel import worker_count
from mergekit_ram.integration import cpus as machine_cpus


@pytest.fixture
def torch_threads():
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


@pytest.mark.parametrize("mask", [{0}, {2, 5, 7}, set(range(64))])
def test_usable_cpus_are_the_affinity_mask(mask, monkeypatch):
    monkeypatch.setattr(machine_cpus.os, "sched_getaffinity", lambda _pid: mask)
    monkeypatch.setattr(machine_cpus.os, "cpu_count", lambda: 128)
    assert machine_cpus.usable_cpus() == len(mask)


@pytest.mark.parametrize("count, usable", [(6, 6), (None, 1)])
def test_without_an_affinity_call_every_cpu_counts(count, usable, monkeypatch):
    """macOS and Windows have no os.sched_getaffinity; os.cpu_count() may be None."""
    monkeypatch.delattr(machine_cpus.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(machine_cpus.os, "cpu_count", lambda: count)
    assert machine_cpus.usable_cpus() == usable


@pytest.mark.parametrize("mask, threads, workers", [(8, 3, 3), (2, 6, 2)])
def test_the_pool_is_the_mask_at_most_torch_threads(
    mask, threads, workers, torch_threads, monkeypatch
):
    """A taskset mask and torch's thread setting, whichever is smaller."""
    monkeypatch.setattr(
        machine_cpus.os, "sched_getaffinity", lambda _pid: set(range(mask))
    )
    torch_threads(threads)
    assert worker_count(torch.device("cpu"), machine_cpus.usable_cpus()) == workers
