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
from functools import partial

import torch
from torch import Tensor

from mergekit_ram.core.checks import Group, check_layout, from_base
from mergekit_ram.core.kernel import overlaps
from mergekit_ram.core.rule import ScaleRule


def tensor_overlaps(
    base: Tensor, tasks: Sequence[Tensor], epsilon: float
) -> tuple[list[list[int]], list[list[int]]]:
    """(histograms, intersections) of one tensor group (`core.kernel.overlaps`).

    histograms[t][k]: task t's changed elements that k other tasks change too;
    intersections[s][t] = |m_s ∧ m_t|.
    """
    return overlaps(base, tasks, epsilon, COUNT_CHUNK)[:2]


# Elements per step of the chunked count: its float32 rows stay in the CPU
# cache, and no tensor-sized float32 copy is allocated (touching fresh pages
# costs more than the arithmetic); docs/performance.md has the measurements.
COUNT_CHUNK = 1 << 18
# Elements per step of the count that also sums inner products.
PRODUCT_CHUNK = 1 << 16


def add_histogram(total: list[int], row: Sequence[int]) -> None:
    """Add a k-way histogram into a running total (the one place they are summed)."""
    total.extend([0] * (len(row) - len(total)))  # nothing when it is longer
    total[: len(row)] = [t + int(value) for t, value in zip(total, row)]


@dataclass
class Products:
    """Inner products of one tensor's task vectors, summed in float64.

    With τ_s the task vectors, m_s their change masks and c the overlap count
    (docs/spec.md): gram[s][t] = ⟨τ_s, τ_t⟩; owned[s][t] = ⟨τ_s·[c = 1]·m_s,
    τ_t⟩ (s's unique elements); ram[t] = ⟨τ_RAM, τ_t⟩ with τ_RAM the RAM merge
    at λ = 1 (Σ_active τ / c). RAM+ scales only s's unique elements by λ_s,
    so its product is ram[t] + Σ_s (λ_s − 1)·owned[s][t]; task arithmetic's
    is Σ_s w·gram[s][t]. Full τ, sub-threshold values included, so the
    numbers are exact inner products of the float32 vectors.
    """

    ids: list[Hashable]
    gram: list[list[float]]
    owned: list[list[float]]
    ram: list[float]


@torch.no_grad()
def inner_products(block: Tensor, counts: Tensor, epsilon: float) -> Tensor:
    """One chunk's (2N+1, N) float64 block of Products' sums.

    block (2N+1, n) float32 holds the N task vectors τ in its first rows
    (core.kernel.chunked_walk's rows, reused for every chunk); counts
    (n,) the overlap count. The other rows are filled here (owned, then RAM's
    merged τ at λ = 1). Rows of the result: gram, owned, ram (Products).
    """
    n = (block.shape[0] - 1) // 2
    taus = block[:n]
    # τ·m in one fused step (hardshrink is exactly the change mask's rule for
    # finite values), about three times cheaper than multiplying by the mask.
    changed = torch.nn.functional.hardshrink(taus, epsilon)
    unique = torch.eq(counts, 1, out=torch.empty_like(taus[0]))
    torch.mul(changed, unique, out=block[n : 2 * n])
    torch.sum(changed, 0, out=block[2 * n]).div_(counts.clamp(min=1))
    del changed
    # One matrix-vector product per task: faster than one matrix product here.
    columns = [torch.mv(block, taus[t]) for t in range(n)]
    return torch.stack(columns, dim=1).to("cpu", torch.float64)


@dataclass
class TaskCounts:
    """One task's counts; histogram[k]: changed elements k other tasks change too."""

    histogram: list[int] = field(default_factory=list)
    elements: int = 0
    # Other task → changed elements both change (|m_self ∧ m_other|).
    intersections: dict[Hashable, int] = field(default_factory=dict)

    def add(self, other: TaskCounts) -> None:
        add_histogram(self.histogram, other.histogram)
        self.elements += other.elements
        for task, value in other.intersections.items():
            self.intersections[task] = self.intersections.get(task, 0) + value

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
        self, name: str, task: Hashable, elements: int, histogram: list, scale: float
    ) -> None:
        with self._lock:
            counts = TaskCounts(histogram, elements)
            self.tasks.setdefault(task, TaskCounts()).add(counts)
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
    # Also sum inner products per tensor (Products) into `products`.
    inner_products: bool = False
    products: dict[str, Products] = field(default_factory=dict)

    def add(self, name: str, base: Tensor, tasks: Group) -> bool:
        """Count one tensor group (base plus task models' tensors); returns
        whether every task vector was finite (`core.kernel.overlaps`)."""
        if name in self.per_tensor:
            raise ValueError(f"tensor {name!r} counted twice")
        ids, n, summing = list(tasks), len(tasks), self.inner_products
        each = partial(inner_products, epsilon=self.epsilon) if summing else None
        chunk = PRODUCT_CHUNK if summing else COUNT_CHUNK
        counted = overlaps(base, list(tasks.values()), self.epsilon, chunk, each)
        rows, pairs, finite, sums = counted
        if summing:  # float64 sums in chunk order, as Python's would be
            found = sum(sums, torch.zeros((2 * n + 1, n), dtype=torch.float64)).tolist()
            self.products[name] = Products(ids, found[:n], found[n : 2 * n], found[-1])
        local = self.per_tensor.setdefault(name, {})
        for s, (task_id, row) in enumerate(zip(ids, rows)):
            shared_with = {o: pairs[s][t] for t, o in enumerate(ids) if t != s}
            counts = TaskCounts(list(row), base.numel(), shared_with)
            local.setdefault(task_id, TaskCounts()).add(counts)
            self.tasks.setdefault(task_id, TaskCounts()).add(counts)
        self.num_tensors += 1
        self.num_elements += base.numel()
        return finite

    def in_order(self, names: Iterable[str]) -> None:
        """Reorder as if the tensors had been added in `names`' order.

        A pass may read its groups in any order (the statistics pass walks
        the merge's backwards); per-tensor entries, inner products and the
        task order (first appearance) then follow `names`, and the totals are
        re-added in it, so whatever iterates them (the report's float sums
        included) sees the same sequence. `names` must hold every tensor added.
        """
        order = [name for name in names if name in self.per_tensor]
        if missing := self.per_tensor.keys() - set(order):
            raise ValueError(f"tensors missing from the order: {sorted(missing)}")
        self.per_tensor = {name: self.per_tensor[name] for name in order}
        self.products = {n: self.products[n] for n in order if n in self.products}
        self.tasks = {}
        for local in self.per_tensor.values():
            for task_id, counts in local.items():
                self.tasks.setdefault(task_id, TaskCounts()).add(counts)

    def scales(
        self,
        rule: ScaleRule,
        explicit: Mapping[Hashable, float | None] | None = None,
        counts: Mapping[Hashable, TaskCounts] | None = None,
    ) -> dict[Hashable, float]:
        """λ per task from the whole-model totals (or from `counts`: one
        tensor's, for tensor-local λ).

        A task's explicit (non-None) value replaces its computed λ.
        """
        counts = self.tasks if counts is None else counts
        scales = {t: rule.scale(c.shared, c.unique) for t, c in counts.items()}
        return scales | {t: v for t, v in (explicit or {}).items() if v is not None}


def group_tensors(
    tensors: Group,
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
    # .to(None) is the tensor itself.
    tasks = {m: tensors[m].to(device) for m in order if m != base_id and m in tensors}
    return base.to(device), tasks
