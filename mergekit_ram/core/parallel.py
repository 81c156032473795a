"""Worker threads for the chunked walks over a tensor's elements.

The merge kernel and the overlap count walk a tensor a chunk at a time; on
CPU the chunks are shared out, in contiguous runs, among Python threads that
each run their torch ops on one thread (no per-op synchronisation, and a busy
core only slows its own run). How many: torch's thread count, which follows
the process's affinity mask and which a caller may lower on purpose. One pool
serves a whole merge (`workers`), not one per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class Workers(ThreadPoolExecutor):
    """A pool of `count − 1` threads; the calling thread is the count-th.

    Its threads start on first use; `split` may be called from several
    threads at once.
    """

    def __init__(self, count: int) -> None:
        self.count = max(1, count)
        super().__init__(max(1, self.count - 1), thread_name_prefix="mergekit-ram")

    def split(
        self, work: Callable[[Tensor], T], items: Tensor, device: torch.device
    ) -> list[T]:
        """`work` on contiguous runs of `items`, one run per worker on CPU
        (one run elsewhere: the device parallelises each op); results in run
        order.

        Meanwhile the calling thread's torch CPU ops run on one thread (the
        pool's threads take the setting in force when they first compute): a
        walk runs some forty small in-cache ops per chunk, and splitting each
        over threads costs more than it saves, several times more on a busy
        machine, where a woken thread waits for a core.
        """
        count = self.count if device.type == "cpu" else 1
        runs = items.tensor_split(max(1, min(count, len(items))))
        saved = torch.get_num_threads()
        if device.type == "cpu" and saved != 1:
            torch.set_num_threads(1)  # torch keeps it per OS thread
        others = [self.submit(work, run) for run in runs[1:]]
        try:
            first = work(runs[0])
        finally:
            # Every run ends before the caller sees an error (they write
            # into buffers the caller owns).
            wait(others)
            if torch.get_num_threads() != saved:
                torch.set_num_threads(saved)
        return [first, *(other.result() for other in others)]


_CURRENT: ContextVar[Workers | None] = ContextVar("mergekit_ram_workers", default=None)


@contextmanager
def workers() -> Iterator[Workers]:
    """The pool of the merge in progress, or a new one for the block (one
    worker per torch thread, closed after) that chunked walks inside it use."""
    if (pool := _CURRENT.get()) is not None:
        yield pool
        return
    with Workers(torch.get_num_threads()) as pool, using(pool):
        yield pool


@contextmanager
def binding(var: ContextVar[T | None], value: T | None) -> Iterator[bool]:
    """`value` as `var`'s for the block, unless it is None or already bound;
    yields whether it was bound here."""
    token = None if value is None or var.get() is value else var.set(value)
    try:
        yield token is not None
    finally:
        if token is not None:
            var.reset(token)


def using(pool: Workers | None) -> AbstractContextManager[bool]:
    """Bind `pool` for the block (a merge task on a thread of its own)."""
    return binding(_CURRENT, pool)
