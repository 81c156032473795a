"""Overlap statistics: C, S, U and the k-way histogram per task (docs/spec.md).

`tensor_overlaps` counts one tensor group (with `core.kernel.overlaps`, the
one count, which the merge's tensor-local λ uses too); `OverlapStatistics`
adds groups up per task, in total and per output tensor.
Pairwise intersections |m_s ∧ m_t| (for Jaccard overlaps) are counted
alongside, from the same masks. Asked for (`inner_products`), the same pass
also sums the task vectors' inner products from which `analysis.regime` derives
how much of each task vector a merge keeps. Streaming over a planned
mergekit merge is mergekit_ram.integration.statistics.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mergekit_ram.core.checks import check_layout, from_base
from mergekit_ram.core.kernel import (
    change_mask,
    count_masks,
    overlaps,
    overlaps_of,
    task_vector_into,
)
from mergekit_ram.core.parallel import one_cpu_thread
from mergekit_ram.core.products import Products, inner_products
from mergekit_ram.core.scale import ScaleRule


def tensor_overlaps(
    base: torch.Tensor, tasks: Sequence[torch.Tensor], epsilon: float
) -> tuple[list[list[int]], list[list[int]]]:
    """(histograms, intersections) of one tensor group, COUNT_CHUNK elements
    a step (`core.kernel.overlaps`).

    histograms[t][k]: task t's changed elements that k other tasks change too;
    intersections[s][t] = |m_s ∧ m_t|.
    """
    rows, pairs, _ = overlaps(base, tasks, epsilon, COUNT_CHUNK)
    return rows, pairs


# Elements per step of the chunked count: its float32 rows stay in the CPU
# cache, and no tensor-sized float32 copy is allocated (touching fresh pages
# costs more than the arithmetic). Measured by benchmarks/count_chunk.py;
# docs/performance.md has its table.
COUNT_CHUNK = 1 << 18


# Elements per step of the pass that also sums inner products: the task
# vectors of a chunk stay in cache, and no full-size float32 copy is made.
PRODUCT_CHUNK = 1 << 16


@torch.no_grad()
def overlaps_and_products(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    epsilon: float,
    ids: Sequence[Hashable],
) -> tuple[list[list[int]], list[list[int]], Products]:
    """tensor_overlaps' counts and the tensor's Products, from one read.

    A chunk at a time: every task's τ (kept, not overwritten by |τ|), its
    mask and the overlap count, as the merge makes them.
    """
    count = len(tasks)
    products = Products.zeros(ids)
    rows = [[0] * count for _ in range(count)]
    pairs = [[0] * count for _ in range(count)]
    flat_base = base.reshape(-1)
    flat_tasks = [task.reshape(-1) for task in tasks]
    size = min(PRODUCT_CHUNK, flat_base.numel())
    like = dict(dtype=torch.float32, device=base.device)
    base32 = torch.empty(size, **like)
    block = torch.empty((2 * count + 1, size), **like)  # τ rows first
    scratch = torch.empty((count, size), **like)  # |τ|
    with one_cpu_thread(base.device):
        for start in range(0, flat_base.numel() if count else 0, PRODUCT_CHUNK):
            stop = min(start + PRODUCT_CHUNK, flat_base.numel())
            chunk = base32[: stop - start].copy_(flat_base[start:stop])
            part = block[:, : stop - start]
            for index, task in enumerate(flat_tasks):
                task_vector_into(part[index], task[start:stop], chunk)
            # |τ| into the scratch rows (abs_ on |τ| again is a no-op).
            magnitude = torch.abs(part[:count], out=scratch[:, : stop - start])
            masks = change_mask(magnitude, epsilon, overwrite=True)
            part_rows, part_pairs = overlaps_of(list(masks), chunk)
            for s in range(count):
                add_histogram(rows[s], part_rows[s])
                for t in range(count):
                    pairs[s][t] += part_pairs[s][t]
            counts = count_masks(list(masks), chunk)
            products.add(inner_products(part, counts, epsilon))
    return rows, pairs, products


def add_histogram(total: list[int], row: Sequence[int]) -> None:
    """Add a k-way histogram into a running total (the one place they are summed)."""
    if len(total) < len(row):
        total.extend([0] * (len(row) - len(total)))
    for k, value in enumerate(row):
        total[k] += int(value)


@dataclass
class TaskCounts:
    """One task's counts; histogram[k]: changed elements k other tasks change too."""

    histogram: list[int] = field(default_factory=list)
    elements: int = 0
    # Other task → changed elements both change (|m_self ∧ m_other|).
    intersections: dict[Hashable, int] = field(default_factory=dict)

    @property
    def changed(self) -> int:
        return sum(self.histogram)

    @property
    def unique(self) -> int:
        return self.histogram[0] if self.histogram else 0

    @property
    def shared(self) -> int:
        return self.changed - self.unique

    @property
    def rho(self) -> float:
        """ρ = S/U; infinite when the task has shared but no unique elements."""
        if self.unique:
            return self.shared / self.unique
        return math.inf if self.shared else 0.0


@dataclass
class LocalScales:
    """What tensor-local RAM+ computed, per task: its counts summed over the
    tensors it merged, and the smallest and largest λ a tensor gave it.
    Merge tasks may run on several threads (--multi-gpu): `add` is locked."""

    tasks: dict[Hashable, TaskCounts] = field(default_factory=dict)
    scales: dict[Hashable, tuple[float, float]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(
        self,
        name: str,
        task: Hashable,
        elements: int,
        histogram: list[int],
        scale: float,
    ) -> None:
        with self._lock:
            total = self.tasks.setdefault(task, TaskCounts())
            add_histogram(total.histogram, histogram)
            total.elements += elements
            low, high = self.scales.get(task, (scale, scale))
            self.scales[task] = (min(low, scale), max(high, scale))
            self.names.add(name)


@dataclass
class OverlapStatistics:
    """Counts per task model, over all added tensors and per tensor."""

    epsilon: float
    tasks: dict[Hashable, TaskCounts] = field(default_factory=dict)
    per_tensor: dict[str, dict[Hashable, TaskCounts]] = field(default_factory=dict)
    num_tensors: int = 0
    num_elements: int = 0
    seconds: float = 0.0
    # Also sum inner products per tensor (core.products.Products) into `products`.
    inner_products: bool = False
    products: dict[str, Products] = field(default_factory=dict)

    def add(
        self,
        name: str,
        base: torch.Tensor,
        tasks: Mapping[Hashable, torch.Tensor],
    ) -> bool | None:
        """Count one tensor group (base plus task models' tensors); returns
        whether every task vector was finite (None: not checked, see
        `core.kernel.overlaps`; never with inner products)."""
        if name in self.per_tensor:
            raise ValueError(f"tensor {name!r} counted twice")
        ids = list(tasks)
        inputs = [tasks[i] for i in ids]
        finite = None
        if self.inner_products:
            rows, pairs, products = overlaps_and_products(
                base, inputs, self.epsilon, ids
            )
            self.products[name] = products
        else:
            rows, pairs, finite = overlaps(
                base, inputs, self.epsilon, COUNT_CHUNK, checked=True
            )
        local = {}
        for s, (task_id, row) in enumerate(zip(ids, rows)):
            shared_with = {o: pairs[s][t] for t, o in enumerate(ids) if t != s}
            local[task_id] = TaskCounts(list(row), base.numel(), shared_with)
            self._add_to_total(task_id, local[task_id])
        self.per_tensor[name] = local
        self.num_tensors += 1
        self.num_elements += base.numel()
        return finite

    def _add_to_total(self, task_id: Hashable, counts: TaskCounts) -> None:
        """Add one tensor's counts of a task to its totals (add and in_order)."""
        total = self.tasks.setdefault(task_id, TaskCounts())
        add_histogram(total.histogram, counts.histogram)
        total.elements += counts.elements
        for other, value in counts.intersections.items():
            total.intersections[other] = total.intersections.get(other, 0) + value

    def in_order(self, names: Iterable[str]) -> None:
        """Reorder as if the tensors had been added in `names`' order.

        A pass may read its groups in any order (the statistics pass walks
        the merge's backwards); per-tensor entries, inner products and the
        task order (first appearance) then follow `names`, and the totals are
        re-added in it, so whatever iterates them (the report's float sums
        included) sees the same sequence. `names` must hold every tensor added.
        """
        order = [name for name in names if name in self.per_tensor]
        missing = self.per_tensor.keys() - set(order)
        if missing:
            raise ValueError(f"tensors missing from the order: {sorted(missing)}")
        self.per_tensor = {name: self.per_tensor[name] for name in order}
        self.products = {n: self.products[n] for n in order if n in self.products}
        self.tasks = {}
        for local in self.per_tensor.values():
            for task_id, counts in local.items():
                self._add_to_total(task_id, counts)

    def scales(
        self,
        rule: ScaleRule,
        explicit: Mapping[Hashable, float | None] | None = None,
    ) -> dict[Hashable, float]:
        """Global λ per task from the whole-model totals.

        A task's explicit (non-None) value replaces its computed λ.
        """
        scales = {
            task_id: rule.scale(counts.shared, counts.unique)
            for task_id, counts in self.tasks.items()
        }
        scales.update({t: v for t, v in (explicit or {}).items() if v is not None})
        return scales


def group_tensors(
    tensors: Mapping[Hashable, torch.Tensor],
    base_id: Hashable,
    order: Iterable[Hashable],
    device: torch.device | None,
    *,
    name: str,
    vocabulary_axis: int | None = None,
) -> tuple | None:
    """(base, {task: tensor}) on `device`, or None for a group RAM does not merge.

    Nothing is counted where the base is missing or not floating point (an
    integer or bool buffer, which the merge copies from the base); otherwise
    every task tensor must have the base's layout (RAMInputError).
    """
    base = tensors.get(base_id)
    if base is None or from_base(base.dtype):
        return None
    check_layout(name, tensors, base_id, vocabulary_axis)
    move = (lambda t: t.to(device)) if device is not None else (lambda t: t)
    tasks = {m: move(tensors[m]) for m in order if m != base_id and m in tensors}
    return move(base), tasks
