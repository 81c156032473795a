"""The RAM merge rule for one tensor, and the one count walk (docs/spec.md).

Everything is computed in float32 whatever the stored dtype, helper tensors live
on the inputs' device and inputs are never written. The merge and the count
walk a tensor a chunk at a time through `ChunkReader` (so both apply the same
τ and change mask), on the threads of `core.parallel`: nothing tensor-sized is
allocated besides the output, however many task models there are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mergekit_ram.core.parallel import run_on

# Called with (task index, that task's k-way histogram in this tensor) when a
# task has no explicit scale; returns the scale for its unique elements.
ScaleFn = Callable[[int, torch.Tensor], float]
# Called once per task whose scale λ ≠ 1 with (task index, its unique elements
# in this tensor, how many of them λ still changes once rounded to the output
# dtype).
RescaleFn = Callable[[int, int, int], None]
T = TypeVar("T")


def task_vector(
    task: torch.Tensor, base32: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """τ = θ_t − θ₀ in float32, into `out` (else a new tensor); the inputs
    are untouched.

    The task is rounded to float32 first (exact for half precision), then the
    base subtracted; copying first is several times faster on CPU than a
    mixed-dtype subtraction and gives the same bits.
    """
    out = torch.empty_like(base32) if out is None else out
    return out.copy_(task).sub_(base32)


def change_mask(
    tau: torch.Tensor, epsilon: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """m = |τ| > ε, strict and absolute (`out`: bool, or float32 for 1.0 /
    0.0, which holds |τ| on the way: on CPU a comparison written to float32
    costs a fraction of one written to bool)."""
    same = out is not None and out.dtype == tau.dtype
    magnitude = torch.abs(tau, out=out) if same else tau.abs()
    return torch.gt(magnitude, epsilon, out=out)


@torch.no_grad()
def overlap_counts(
    base32: torch.Tensor, tasks: Sequence[torch.Tensor], epsilon: float
) -> torch.Tensor:
    """c_i: how many task models change element i (int32, whole tensor)."""
    counts = torch.zeros(base32.shape, dtype=torch.int32, device=base32.device)
    for task in tasks:
        counts += change_mask(task_vector(task, base32), epsilon)
    return counts


# Elements per step of the chunked merge on CPU: its float32 rows (two per
# task model and a few more) stay in the CPU's caches, and the forty-odd ops
# of a step cost more in dispatch than in arithmetic below it
# (docs/performance.md).
MERGE_CHUNK = 1 << 17
# Off the CPU a step costs per launched op, not per cache miss: far larger.
DEVICE_CHUNK = 1 << 24


@dataclass
class Chunk:
    """Elements [start, stop) of a tensor group (views of a ChunkReader's rows)."""

    base32: torch.Tensor  # θ₀ in float32
    tau: torch.Tensor  # (tasks, width): τ_t, one row per task model
    mask: torch.Tensor  # (tasks, width): m_t as 1.0 / 0.0
    counts: torch.Tensor  # c, float32


class ChunkReader:
    """One worker's float32 rows for walking a tensor group a chunk at a time.

    Masks are float32: counted, multiplied into τ and multiplied together by
    arithmetic, which on CPU costs a fraction of the same work on bool.
    `taus` and `masks` hold `extra` more rows below the tasks' for the caller.
    """

    def __init__(
        self,
        flat_base: torch.Tensor,
        flat_tasks: Sequence[torch.Tensor],
        epsilon: float,
        width: int,
        extra: tuple[int, int] = (0, 0),
    ) -> None:
        self.width, self.device = width, flat_base.device
        like: dict[str, Any] = dict(dtype=torch.float32, device=self.device)
        self._base, self._tasks, self._epsilon = flat_base, flat_tasks, epsilon
        n = len(flat_tasks)
        self._base32 = torch.empty(width, **like)
        self.taus = torch.empty((n + extra[0], width), **like)
        self.masks = torch.empty((n + extra[1], width), **like)
        self._counts = torch.empty(width, **like)

    def read(
        self,
        start: int,
        stop: int,
        summed: torch.Tensor | None = None,
        counted: bool = True,
    ) -> Chunk:
        """θ₀, τ, m and (`counted`) c of elements [start, stop), overwriting
        the last chunk read; `summed`: a float32 scalar to add Σ τ to."""
        width, n = stop - start, len(self._tasks)
        base32 = self._base32[:width].copy_(self._base[start:stop])
        tau, mask = self.taus[:n, :width], self.masks[:n, :width]
        for row, task in zip(tau, self._tasks):
            task_vector(task[start:stop], base32, out=row)
        if summed is not None:
            summed += tau.sum()
        change_mask(tau, self._epsilon, out=mask)
        counts = self._counts[:width]
        if counted:
            torch.sum(mask, 0, out=counts)  # exact: sums of 0 / 1
        return Chunk(base32, tau, mask, counts)


def chunked_walk(
    flat_base: torch.Tensor,
    chunk: int,
    work: Callable[[list[tuple[int, int]]], T],
    *,
    exact: bool = False,
) -> list[T]:
    """`work` on contiguous runs of the (start, stop) steps over flat_base, one
    run per worker thread of the current pool (`core.parallel`); results in
    run order. Every worker makes its own buffers in `work`. A step is
    `chunk` elements on CPU, at least DEVICE_CHUNK elsewhere unless `exact`
    (float sums that depend on where the chunks end)."""
    total, device = flat_base.numel(), flat_base.device
    size = chunk if device.type == "cpu" or exact else max(chunk, DEVICE_CHUNK)

    def steps(run: torch.Tensor) -> T:
        return work([(s, min(s + size, total)) for s in run.tolist()])

    return run_on(steps, torch.arange(0, total, size), device)


# The signed integer type of each float width: comparing written values by
# their bits costs one integer subtraction.
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


# No autograd: weights that require grad (module inputs) merge as plain data,
# and the in-place steps with out= would otherwise be refused.
@torch.no_grad()
def ram_merge_tensor(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    *,
    epsilon: float,
    scales: Sequence[float | None],
    scale_fn: ScaleFn | None = None,
    out_dtype: torch.dtype | None = None,
    on_rescaled: RescaleFn | None = None,
    on_nonfinite: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Merge one tensor by the RAM rule; returns out_dtype (default: base's).

    The float32 result is rounded once, to the dtype that will be written.

    Unchanged elements keep θ₀, unique elements get θ₀ + λ_t·τ_t, shared ones
    θ₀ + Σ_active τ_t / c (the mean of the active task vectors, summed in task
    order as stock mergekit does, so λ = 1 reproduces it bit for bit). A task
    whose scale is None gets `scale_fn(index, histogram)` from this tensor's
    own counts (the tensor-local statistics scope; one more read of the
    inputs). `on_rescaled` hears, for each task with λ ≠ 1, how many unique
    elements it rescaled and how many of those still differ from RAM's value
    once written. Callers refuse or replace non-finite inputs (the
    `nonfinite` rule): first, or, refusing, after the walk, which calls
    `on_nonfinite` when some chunk's sum of τ was not finite (every τ is
    finite otherwise; an overflowing sum only says "look closer"), so the
    inputs need no read of their own. A τ that is NaN (a non-finite base,
    which `nonfinite: ignore` hands on with every task's value there replaced
    by it) counts as unchanged, as in the count, so such an element keeps
    the base's value.
    """
    if len(scales) != len(tasks):
        raise ValueError(f"{len(tasks)} task tensors but {len(scales)} scales")
    written = out_dtype or base.dtype
    if not tasks:
        return base.to(dtype=written, copy=True)
    lambdas = _resolved_scales(base, tasks, epsilon, scales, scale_fn)
    flat_base = base.reshape(-1)
    flat_tasks = [task.reshape(-1) for task in tasks]
    out = torch.empty(flat_base.shape, dtype=written, device=base.device)
    tally = on_rescaled is not None and any(scale != 1.0 for scale in lambdas)

    def merge(steps: list[tuple[int, int]]) -> tuple[torch.Tensor | None, bool]:
        width = max((stop - start for start, stop in steps), default=0)
        merger = _ChunkMerge(
            ChunkReader(flat_base, flat_tasks, epsilon, width), lambdas, written, tally
        )
        for start, stop in steps:
            merger.merge(start, stop, out[start:stop])
        return merger.tally, merger.doubtful

    walked = chunked_walk(flat_base, MERGE_CHUNK, merge)
    if on_nonfinite is not None and any(doubtful for _, doubtful in walked):
        on_nonfinite()
    if on_rescaled is not None and tally:
        totals = sum(tally for tally, _ in walked).tolist()
        for index, scale in enumerate(lambdas):
            if scale != 1.0:
                on_rescaled(index, int(totals[index][0]), int(totals[index][1]))
    return out.view(base.shape)


def _resolved_scales(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    epsilon: float,
    scales: Sequence[float | None],
    scale_fn: ScaleFn | None,
) -> list[float]:
    """λ per task: its scale, or scale_fn on its k-way histogram in this
    tensor (counted once for all such tasks, before any element is merged)."""
    missing = [index for index, scale in enumerate(scales) if scale is None]
    if not missing:
        return [float(scale) for scale in scales]
    if scale_fn is None:
        raise ValueError(f"no scale for task {missing[0]} and no scale_fn")
    rows = overlaps(base, tasks, epsilon, MERGE_CHUNK)[0]
    return [
        float(scale_fn(index, torch.tensor(rows[index])) if scale is None else scale)
        for index, scale in enumerate(scales)
    ]


class _ChunkMerge:
    """One worker's buffers and steps for ram_merge_tensor, a chunk at a time.

    In float32: δ = Σ_t τ_t·m_t / max(c, 1) summed in task order (τ/c on the
    changed elements, as stock mergekit sums; a zero of either sign where
    c = 0, which leaves θ₀ + δ = θ₀ unless θ₀ is −0.0: see `merge`).
    RAM+ multiplies δ by Λ = λ_t on task t's unique elements and 1
    elsewhere, which is exact (δ = τ_t there; x·1 = x), and θ₀ + δ is
    rounded into the output. With `tally` it also rounds θ₀ + δ before Λ
    (RAM's value) and counts, per task, its unique elements and those whose
    written bits differ.
    """

    def __init__(
        self,
        reader: ChunkReader,
        scales: Sequence[float],
        written: torch.dtype,
        tally: bool,
    ) -> None:
        self.reader = reader
        self.rescales = any(scale != 1.0 for scale in scales)
        width, device = reader.width, reader.device
        # λ as float32 holds it (the plan refuses one beyond float32's range).
        self.scales = torch.tensor(list(scales), dtype=torch.float32).tolist()
        like: dict[str, Any] = dict(dtype=torch.float32, device=device)
        self.delta = torch.empty(width, **like)
        self.scratch = torch.empty(width, **like)
        self.factor = torch.empty(width, **like)
        # Row 0: 1.0 on unique elements (c = 1); row 1 (tally): 1.0 where RAM+
        # and RAM are written apart.
        self.rows = torch.empty((2, width), **like)
        self.plain = torch.empty(width, dtype=written, device=device)
        self.tally = (
            torch.zeros((len(scales), 2), dtype=torch.float64, device=device)
            if tally
            else None
        )
        self.doubtful = False  # some chunk's Σ τ was not finite

    def merge(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements [start, stop) into `out` (that slice of the output)."""
        part = self.reader.read(start, stop)
        width = stop - start
        tau = part.tau.mul_(part.mask)
        tau.div_(torch.clamp(part.counts, min=1, out=self.scratch[:width]))
        if _has_negative_zero(part.base32):
            # Only θ₀ = −0.0 tells the sign of a zero δ apart (x + ±0 = x
            # otherwise): there a task leaving an element unchanged adds
            # exactly −0.0, as mergekit's where() has it.
            tau.masked_fill_(part.mask == 0, -0.0)
        delta = self._sum(tau)
        if not (delta.is_meta or bool(torch.isfinite(delta.sum()))):
            # A τ that is NaN or ±∞ (NaN·0 where its mask is 0 included):
            # refusing, the caller checks the inputs; ignoring, it is a
            # non-finite base's, and that task leaves the element unchanged,
            # as mergekit's where() has it; ±∞ stays.
            self.doubtful = True
            torch.nan_to_num_(tau, nan=0.0, posinf=math.inf, neginf=-math.inf)
            delta = self._sum(tau)
        if self.rescales:
            unique = torch.eq(part.counts, 1, out=self.rows[0, :width])
            factor = self._factor(part.mask, part.counts, unique)
            if self.tally is not None:
                plain = torch.add(part.base32, delta, out=self.scratch[:width])
                self.plain[:width].copy_(plain)
            delta.mul_(factor)
        out.copy_(delta.add_(part.base32))
        if self.tally is not None:
            self._count(part.mask, out)

    def _sum(self, tau: torch.Tensor) -> torch.Tensor:
        """Σ_t of the rows of `tau`, in task order, into `delta`."""
        delta = self.delta[: tau.shape[1]].copy_(tau[0])
        for row in tau[1:]:
            delta.add_(row)
        return delta

    def _factor(
        self, mask: torch.Tensor, counts: torch.Tensor, unique: torch.Tensor
    ) -> torch.Tensor:
        """Λ = (1 − u) + u·Σ_t λ_t·m_t: λ of the one task changing a unique
        element, 1 elsewhere; exact, as every product is by 0 or 1."""
        width = unique.numel()
        lam = torch.mul(mask[0], self.scales[0], out=self.factor[:width])
        for row, scale in zip(mask[1:], self.scales[1:]):
            lam.add_(row, alpha=scale)
        kept = torch.ne(counts, 1, out=self.scratch[:width])
        return torch.addcmul(kept, unique, lam, out=lam)

    def _count(self, mask: torch.Tensor, out: torch.Tensor) -> None:
        """Add, per task, [unique elements, of which written apart from RAM]."""
        width = out.numel()
        bits = _BITS[out.element_size()]
        apart = self.plain[:width].view(bits).sub_(out.view(bits))
        self.rows[1, :width].copy_(apart).ne_(0)
        # Sums of 0 / 1 over one chunk: exact in float32.
        self.tally += torch.mm(mask, self.rows[:, :width].T)


def _has_negative_zero(values: torch.Tensor) -> bool:
    """Whether float32 `values` hold −0.0: its bits are int32's minimum
    (tensors without data, on the meta device, hold none)."""
    bits = values.view(torch.int32)
    if bits.numel() == 0 or bits.is_meta:
        return False
    return int(bits.min()) == torch.iinfo(torch.int32).min


# Called per chunk of a count walk with a (2N+1, width) float32 block holding
# the chunk's τ in its first N rows (the rest is the callee's) and c.
ChunkFn = Callable[[torch.Tensor, torch.Tensor], T]
# Up to this many tasks, one code per element holds which tasks change it.
JOINT_LIMIT = 8


@torch.no_grad()
def overlaps(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    epsilon: float,
    chunk: int,
    each: ChunkFn | None = None,
) -> tuple[list[list[int]], list[list[int]], bool, list]:
    """(histograms, intersections, finite, each's results) of one tensor
    group, from one walk over it `chunk` elements a step.

    histograms[t][k]: task t's changed elements that exactly k other tasks
    change too; intersections[s][t] = |m_s ∧ m_t| (the diagonal: each task's
    changed count). Per chunk, up to JOINT_LIMIT tasks, one histogram of the
    masks' joint pattern (bit t: task t changes the element) determines both;
    beyond, one product of the masks with [masks; c = 1 … c = N] counts them
    (sums of 0 / 1, exact in float32). `finite`: whether every τ was finite,
    which (with a task) holds exactly when base and tasks are, save where
    θ_t − θ₀ overflows float32; it rides on one sum per chunk (NaN and ±∞
    carry into it, an overflowing sum only says "look closer":
    checks.finite_inputs). `each` (inner products) runs on every chunk; its
    results come back in chunk order, the chunks ending where they would on
    one thread, so float sums over them do not depend on the workers.
    """
    n, joint = len(tasks), len(tasks) <= JOINT_LIMIT
    flat_base = base.reshape(-1)
    flat_tasks = [task.reshape(-1) for task in tasks]

    def count(steps: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, list]:
        width = max((stop - start for start, stop in steps), default=0)
        extra = (n + 1 if each else 0, 1 if joint else n)
        reader = ChunkReader(flat_base, flat_tasks, epsilon, width, extra)
        shape = (1 << n,) if joint else (n, 2 * n)
        found = torch.zeros(shape, dtype=torch.int64, device=base.device)
        summed = torch.zeros((), dtype=torch.float32, device=base.device)
        results = []
        for start, stop in steps:
            counted = each is not None or not joint
            part = reader.read(start, stop, summed, counted=counted)
            rows = reader.masks[:, : stop - start]
            if joint:
                codes = rows[n].zero_()
                for t, mask in enumerate(part.mask):
                    codes.add_(mask, alpha=1 << t)
                # On CPU float32 → int32 → uint8 costs a third of float32 → uint8.
                codes = codes.to(torch.int32).to(torch.uint8)
                found += torch.bincount(codes, minlength=1 << n)
            else:
                for k, row in enumerate(rows[n:], 1):
                    torch.eq(part.counts, k, out=row)
                found += torch.mm(part.mask, rows.T).to(torch.int64)
            if each is not None:
                results.append(each(reader.taus[:, : stop - start], part.counts))
        return found, summed, results

    walked = chunked_walk(flat_base, chunk, count, exact=each is not None)
    found = sum(part for part, _, _ in walked).tolist()
    finite = all(bool(torch.isfinite(summed)) for _, summed, _ in walked)
    results = [result for _, _, part in walked for result in part]
    if joint:  # every task's histogram and intersections from the patterns
        found, patterns = [[0] * 2 * n for _ in range(n)], found
        for code, elements in enumerate(patterns):
            members = [t for t in range(n) if code >> t & 1]
            for s in members:
                found[s][n + len(members) - 1] += elements
                for t in members:
                    found[s][t] += elements
    return [row[n:] for row in found], [row[:n] for row in found], finite, results
