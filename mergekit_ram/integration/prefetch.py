"""Read-ahead hints for the statistics pass: the next group's input bytes.

mergekit reads a tensor through a memory map when a task first needs it, so
on inputs larger than the page cache the pass alternates between waiting for
the disk and counting. While one group is counted, `ReadAhead` asks the
kernel (posix_fadvise WILLNEED, from a helper thread) to start reading the
byte ranges of the next group's tensors in every input file, so the reads
overlap the counting. A hint never changes what is read or computed: where
posix_fadvise does not exist (Windows), a file is not safetensors, or a hint
fails, the pass reads exactly as before.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mergekit.graph import ExecutionSchedule, TaskHandle
from mergekit.io.tasks import LoaderCache, LoadTensor

from mergekit_ram.integration.checkpoints import safetensors_spans

# (file, first byte, length) of one tensor's data.
Span = tuple[str, int, int]
# What a file that is not the safetensors it claims to be raises here; it
# gets no hint (validation refuses truncated and corrupt files before a pass).
UNREADABLE = (OSError, ValueError, KeyError, TypeError)


def loads_per_group(
    schedule: ExecutionSchedule, targets: Collection[TaskHandle]
) -> list[list[LoadTensor]]:
    """The LoadTensor tasks each target's group runs, in the schedule's order.

    The statistics pass schedules each target right after the tasks it needs
    that have not run yet, so a group's loads are those since the previous
    target."""
    groups: list[list[LoadTensor]] = []
    current: list[LoadTensor] = []
    for handle in schedule.tasks:
        task = handle.task()
        if isinstance(task, LoadTensor):
            current.append(task)
        if handle in targets:
            groups.append(current)
            current = []
    return groups


class ReadAhead:
    """Hints the kernel to read groups' input bytes ahead of their use."""

    def __init__(self) -> None:
        self._spans: dict[str, dict[str, tuple[int, int]]] = {}
        self._files: dict[str, int] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="readahead")

    def spans(self, loads: Iterable[LoadTensor]) -> list[Span]:
        """Where each load's tensor lies on disk (safetensors shards only)."""
        spans = []
        for load in loads:
            loader = LoaderCache().get(load.model)
            # The name the load itself will read (its own, an alias or a tied name).
            name = load._resolve_name(loader)
            if name is None:
                continue
            index = loader.index
            path = os.path.join(index.base_path, index.tensor_paths[name])
            if not path.endswith(".safetensors"):
                continue
            if path not in self._spans:
                self._spans[path] = safetensors_spans(path)
            where = self._spans[path].get(name)
            if where is not None:
                spans.append((path, *where))
        return spans

    def hint(self, loads: Sequence[LoadTensor]) -> None:
        """Start reading these tensors' bytes in the background (best effort)."""
        if not hasattr(os, "posix_fadvise") or not loads:
            return
        try:
            spans = self.spans(loads)
        except UNREADABLE:
            return
        self._worker.submit(self._advise, spans)

    def _advise(self, spans: list[Span]) -> None:
        for path, start, length in spans:
            try:
                if path not in self._files:
                    self._files[path] = os.open(path, os.O_RDONLY)
                os.posix_fadvise(
                    self._files[path], start, length, os.POSIX_FADV_WILLNEED
                )
            except OSError:
                continue

    def close(self) -> None:
        """Wait for pending hints, then close the files they opened."""
        self._worker.shutdown(wait=True)
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()


def hinted(
    pairs: Iterable[tuple[Any, Any]],
    upcoming: Sequence[Sequence[LoadTensor]],
    read_ahead: ReadAhead,
) -> Iterator[tuple[Any, Any]]:
    """Yield `pairs` (one per group, in `upcoming`'s order), hinting the next
    group's loads as each group is handed out."""
    if upcoming:
        read_ahead.hint(upcoming[0])
    for index, pair in enumerate(pairs):
        if index + 1 < len(upcoming):
            read_ahead.hint(upcoming[index + 1])
        yield pair
