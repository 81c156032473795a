"""Worker threads for the chunked walks over a tensor's elements.

The merge kernel and the overlap count walk a tensor a chunk at a time; on
CPU the chunks are shared out, in contiguous runs, among Python threads that
each run their torch ops on one thread (no per-op synchronisation, and a busy
core only slows its own run). How many: torch's thread count, which follows
the process's affinity mask and which a caller may lower on purpose. One pool
serves a whole merge (`workers`), not one per tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

T = TypeVar("T")


class Workers:
    """A pool of `count − 1` threads; the calling thread is the count-th.

    Its threads start on first use and live until `close`; `map` may be
    called from several threads at once.
    """

    def __init__(self, count: int) -> None:
        self.count = max(1, count)
        self._pool = ThreadPoolExecutor(
            max(1, self.count - 1), thread_name_prefix="mergekit-ram"
        )

    def map(
        self,
        work: Callable[[torch.Tensor], T],
        items: torch.Tensor,
        device: torch.device,
    ) -> list[T]:
        """`work` on contiguous runs of `items`, one run per worker on CPU
        (one run elsewhere: the device parallelises each op), with torch's
        CPU ops on one thread meanwhile (restored after); results in run
        order."""
        count = self.count if device.type == "cpu" else 1
        runs = items.tensor_split(max(1, min(count, len(items))))
        with one_cpu_thread(device):
            others = [self._pool.submit(work, run) for run in runs[1:]]
            try:
                first = work(runs[0])
            finally:
                # Every run ends before the caller sees an error (they write
                # into buffers the caller owns).
                wait(others)
        return [first, *(other.result() for other in others)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


_CURRENT: ContextVar[Workers | None] = ContextVar("mergekit_ram_workers", default=None)


@contextmanager
def workers() -> Iterator[Workers]:
    """The pool of the merge in progress, or a new one for the block (one
    worker per torch thread, closed after) that chunked walks inside it use."""
    pool = _CURRENT.get()
    if pool is not None:
        yield pool
        return
    pool = Workers(torch.get_num_threads())
    token = _CURRENT.set(pool)
    try:
        yield pool
    finally:
        _CURRENT.reset(token)
        pool.close()


@contextmanager
def using(pool: Workers | None) -> Iterator[None]:
    """Bind `pool` for the block (a merge task on a thread of its own)."""
    if pool is None or _CURRENT.get() is pool:
        yield
        return
    token = _CURRENT.set(pool)
    try:
        yield
    finally:
        _CURRENT.reset(token)


_HELD = threading.local()


@contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """torch's CPU ops on one thread for the block, the calling thread's
    setting restored after (nested blocks restore it once, at the end).

    A chunked walk runs some forty small in-cache operations per chunk;
    splitting each over threads costs more than it saves, and on a busy
    machine, where a woken thread waits for a core, it made a pass several
    times slower. torch keeps the count per OS thread (OpenMP's), so each
    thread restores its own; a pool's threads take the one in force when
    they first compute. GPU work is unaffected.
    """
    if device.type != "cpu":
        yield
        return
    depth = getattr(_HELD, "depth", 0)
    if depth == 0:
        _HELD.saved = torch.get_num_threads()
        if _HELD.saved != 1:
            torch.set_num_threads(1)
    _HELD.depth = depth + 1
    try:
        yield
    finally:
        _HELD.depth = depth
        if depth == 0 and torch.get_num_threads() != _HELD.saved:
            torch.set_num_threads(_HELD.saved)
