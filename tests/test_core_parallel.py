"""Worker threads that fit the machine (core.parallel): the CPUs this process
may use, one pool per merge, and torch's thread setting given back."""

from __future__ import annotations

import threading

import pytest
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram
from mergekit_ram.core import kernel, parallel
from mergekit_ram.integration.cpus import usable_cpus


@pytest.fixture
def torch_threads():
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


def test_worker_count_is_capped_by_torch_threads_and_one_off_the_cpu(torch_threads):
    torch_threads(2)
    assert parallel.worker_count(torch.device("cpu"), 3) == 2
    torch_threads(6)
    assert parallel.worker_count(torch.device("cpu"), 3) == 3
    assert parallel.worker_count(torch.device("cpu")) == 6  # no CPU count given
    assert parallel.worker_count(torch.device("meta"), 3) == 1


def test_runs_are_contiguous_and_cover_everything():
    assert parallel.contiguous_runs(10, 3) == [range(0, 3), range(3, 6), range(6, 10)]
    assert parallel.contiguous_runs(2, 4) == [range(0, 1), range(1, 2)]
    assert parallel.contiguous_runs(0, 3) == [range(0, 0)]


def test_map_runs_in_order_on_one_torch_thread_and_restores_it(torch_threads):
    torch_threads(2)
    seen = []

    def work(run: range) -> list[int]:
        seen.append((torch.get_num_threads(), threading.get_ident()))
        return list(run)

    pool = parallel.Workers(3)
    try:
        results = pool.map(work, 10, torch.device("cpu"))
        assert results == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
        assert {threads for threads, _ in seen} == {1}
        assert len({ident for _, ident in seen}) >= 2  # the caller and a worker
        assert torch.get_num_threads() == 2
        assert pool.map(work, 4, torch.device("meta")) == [[0, 1, 2, 3]]
    finally:
        pool.close()


def test_an_error_waits_for_every_run_and_restores_the_threads(torch_threads):
    torch_threads(2)
    finished = []

    def work(run: range) -> None:
        if run.start == 0:
            raise RuntimeError("boom")
        finished.append(run.start)

    pool = parallel.Workers(3)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            pool.map(work, 3, torch.device("cpu"))
        assert sorted(finished) == [1, 2]
        assert torch.get_num_threads() == 2
    finally:
        pool.close()


def test_nested_and_concurrent_blocks_restore_each_threads_setting(torch_threads):
    """torch counts threads per OS thread: each block gives back its own."""
    torch_threads(3)
    cpu = torch.device("cpu")
    seen = {}

    def other() -> None:
        before = torch.get_num_threads()
        with parallel.one_cpu_thread(cpu):
            seen["inside"] = torch.get_num_threads()
        seen["restored"] = torch.get_num_threads() == before

    with parallel.one_cpu_thread(cpu):
        with parallel.one_cpu_thread(cpu):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1  # the outer block still runs
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert torch.get_num_threads() == 1
    assert seen == {"inside": 1, "restored": True}
    assert torch.get_num_threads() == 3
    with pytest.raises(RuntimeError):
        with parallel.one_cpu_thread(cpu):
            raise RuntimeError
    assert torch.get_num_threads() == 3


def test_one_pool_serves_a_whole_merge(family_bf16, tmp_path, monkeypatch):
    """Global RAM+ walks every tensor twice (pass and merge) through one pool,
    made when the merge starts and closed when it ends."""
    made, closed = [], []
    workers = parallel.Workers

    class Counted(workers):
        def __init__(self, count: int) -> None:
            made.append(count)
            super().__init__(count)

        def close(self) -> None:
            closed.append(1)
            super().close()

    monkeypatch.setattr(parallel, "Workers", Counted)
    walks = []
    run_on = parallel.run_on

    def counted_walks(*args):
        walks.append(1)
        return run_on(*args)

    monkeypatch.setattr(kernel, "run_on", counted_walks)
    text = family_bf16.yaml("ramplus", parameters={"r": 0.1})
    mergekit_ram.run_merge(
        MergeConfiguration.model_validate(yaml.safe_load(text)),
        str(tmp_path / "out"),
        MergeOptions(quiet=True),
    )
    usable = parallel.worker_count(torch.device("cpu"), usable_cpus())
    assert len(walks) > 2 and made == [usable]
    assert closed == [1]
