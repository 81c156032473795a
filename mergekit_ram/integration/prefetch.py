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

import json
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mergekit.graph import TaskHandle
from mergekit.io.tasks import LoaderCache, LoadTensor

# (file, first byte, length) of one tensor's data.
Span = tuple[str, int, int]


def safetensors_spans(path: str) -> dict[str, tuple[int, int]]:
    """Each tensor's (first byte, length) in a safetensors file, from its header
    (8-byte little-endian length, then the JSON header; data follows it)."""
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    start = 8 + size
    return {
        name: (
            start + entry["data_offsets"][0],
            entry["data_offsets"][1] - entry["data_offsets"][0],
        )
        for name, entry in header.items()
        if name != "__metadata__"
    }


def loads_of(handle: TaskHandle) -> list[LoadTensor]:
    """The LoadTensor tasks a target needs (through any gather or wrapper)."""
    found: list[LoadTensor] = []
    pending, seen = [handle], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        task = current.task()
        if isinstance(task, LoadTensor):
            found.append(task)
        pending.extend(current.arguments().values())
    return found


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
            index = LoaderCache().get(load.model).index
            names = [load.tensor, *(load.aliases or ()), *(load.tied_names or ())]
            name = next((n for n in names if n in index.tensor_paths), None)
            if name is None:
                continue
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
        except (OSError, ValueError, KeyError, struct.error):
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
