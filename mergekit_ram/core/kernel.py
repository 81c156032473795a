"""The RAM merge rule for one tensor (docs/spec.md, "Merge rule").

Everything is computed in float32 whatever the stored dtype, helper tensors live
on the inputs' device and inputs are never written. The merge walks the tensor
a chunk at a time (`ChunkReader`, on the threads of `core.parallel`): per chunk
it forms every task's τ and change mask, the overlap count, RAM's mean, λ on
the unique elements, and writes the chunk rounded once to the output dtype.
Nothing tensor-sized is allocated besides the output, however many task
models there are, and the λ-survival count (does λ still change a unique
element once written?) comes from the same chunk's values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

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


def task_vector_into(
    out: torch.Tensor, task: torch.Tensor, base32: torch.Tensor
) -> torch.Tensor:
    """τ = θ_t − θ₀ in float32, written into `out` (the inputs are untouched).

    The task is rounded to float32 first (exact for half precision), then the
    base subtracted; copying first is several times faster on CPU than a
    mixed-dtype subtraction and gives the same bits.
    """
    return out.copy_(task).sub_(base32)


def task_vector(task: torch.Tensor, base32: torch.Tensor) -> torch.Tensor:
    """τ = θ_t − θ₀ in float32 (a fresh tensor; the inputs are untouched)."""
    return task_vector_into(torch.empty_like(base32), task, base32)


def change_mask(
    tau: torch.Tensor,
    epsilon: float,
    *,
    overwrite: bool = False,
    out: torch.Tensor | None = None,
):
    """m = |τ| > ε, strict and absolute (`overwrite`: τ becomes |τ| in place;
    `out`: a tensor to write m into, bool, or float32 for 1.0 / 0.0, which
    holds |τ| on the way: on CPU a comparison written to float32 costs a
    fraction of one written to bool)."""
    if overwrite:
        magnitude = tau.abs_()
    elif out is not None and out.dtype == tau.dtype:
        magnitude = torch.abs(tau, out=out)
    else:
        magnitude = tau.abs()
    return torch.gt(magnitude, epsilon, out=out)


@torch.no_grad()
def change_masks(
    base32: torch.Tensor, tasks: Sequence[torch.Tensor], epsilon: float
) -> list[torch.Tensor]:
    """m_t per task, via one reused float32 buffer (the one place masks are made)."""
    scratch = torch.empty_like(base32)
    return [
        change_mask(task_vector_into(scratch, task, base32), epsilon, overwrite=True)
        for task in tasks
    ]


def count_masks(
    masks: Sequence[torch.Tensor],
    like: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """c_i: how many masks are set at element i (uint8 below 256 masks).

    The one place masks are counted; `like` gives the shape and device when
    there are none. `out`: a float32 tensor to count float masks (1.0 / 0.0)
    into, exactly (any count below 2^24).
    """
    if out is not None:
        out.zero_()
        for mask in masks:
            out += mask
        return out
    dtype = torch.uint8 if len(masks) < 256 else torch.int32
    counts = torch.zeros(like.shape, dtype=dtype, device=like.device)
    for mask in masks:
        # A bool tensor viewed as bytes adds far faster than one promoted.
        counts += mask.view(torch.uint8) if dtype == torch.uint8 else mask
    return counts


def overlap_counts(
    base32: torch.Tensor, tasks: Sequence[torch.Tensor], epsilon: float
) -> torch.Tensor:
    """c_i: how many task models change element i."""
    return count_masks(change_masks(base32, tasks, epsilon), base32)


def task_histogram(
    counts: torch.Tensor, mask: torch.Tensor, num_tasks: int
) -> torch.Tensor:
    """Entry k: this task's changed elements that exactly k other tasks change too."""
    # Elements outside the mask land in bin 0, which is dropped.
    masked = (counts * mask).flatten()
    if masked.dtype != torch.uint8:
        masked = masked.to(torch.int64)
    return torch.bincount(masked, minlength=num_tasks + 1)[1 : num_tasks + 1].cpu()


# Elements per step of the chunked merge on CPU: its float32 rows (two per
# task model and a few more) stay in the CPU's caches, and the forty-odd ops
# of a step cost more in dispatch than in arithmetic below it. On 16.8 M
# elements, base + 3 bf16 agents, 2 threads: 2^15 / 2^16 / 2^17 / 2^18 took
# 0.17 / 0.11 / 0.09 / 0.09 s for RAM and 0.30 / 0.19 / 0.15 / 0.16 s for
# RAM+ with its survival count (docs/performance.md).
MERGE_CHUNK = 1 << 17
# Off the CPU a step costs per launched op, not per cache miss: far larger.
DEVICE_CHUNK = 1 << 24


def spans(total: int, chunk: int, device: torch.device) -> list[tuple[int, int]]:
    """(start, stop) of each step over range(total): `chunk` elements on CPU,
    at least DEVICE_CHUNK elsewhere."""
    size = max(1, chunk if device.type == "cpu" else max(chunk, DEVICE_CHUNK))
    return [(start, min(start + size, total)) for start in range(0, total, size)]


@dataclass
class Chunk:
    """Elements [start, stop) of a tensor group (views of a ChunkReader's rows)."""

    base32: torch.Tensor  # θ₀ in float32
    tau: torch.Tensor  # (tasks, width): τ_t, one row per task model
    mask: torch.Tensor  # (tasks, width): m_t as 1.0 / 0.0
    counts: torch.Tensor  # c, float32


class ChunkReader:
    """One worker's float32 rows for walking a tensor group a chunk at a time.

    The merge and the overlap count read through it, so both apply the same
    τ and change mask. Masks are float32 (change_mask's `out`): counted, and
    multiplied into τ, by arithmetic, which on CPU costs a fraction of the
    same work on bool.
    """

    def __init__(
        self,
        flat_base: torch.Tensor,
        flat_tasks: Sequence[torch.Tensor],
        epsilon: float,
        width: int,
    ) -> None:
        self.width, self.device = width, flat_base.device
        like = dict(dtype=torch.float32, device=self.device)
        self._base, self._tasks, self._epsilon = flat_base, flat_tasks, epsilon
        self._base32 = torch.empty(width, **like)
        self._tau = torch.empty((len(flat_tasks), width), **like)
        self._mask = torch.empty((len(flat_tasks), width), **like)
        self._counts = torch.empty(width, **like)

    def read(
        self,
        start: int,
        stop: int,
        *,
        counted: bool = True,
        summed: torch.Tensor | None = None,
    ) -> Chunk:
        """θ₀, τ, m and (`counted`) c of elements [start, stop), overwriting
        the last chunk read; `summed`: a float32 scalar to add Σ τ to."""
        width = stop - start
        base32 = self._base32[:width].copy_(self._base[start:stop])
        tau, mask = self._tau[:, :width], self._mask[:, :width]
        for row, task in zip(tau, self._tasks):
            task_vector_into(row, task[start:stop], base32)
        if summed is not None:
            summed += tau.sum()
        change_mask(tau, self._epsilon, out=mask)
        counts = self._counts[:width]
        if counted:
            count_masks(mask, base32, out=counts)
        return Chunk(base32, tau, mask, counts)


def chunked_walk(
    flat_base: torch.Tensor,
    chunk: int,
    work: Callable[[list[tuple[int, int]]], T],
) -> list[T]:
    """`work` on contiguous runs of the steps over flat_base (`spans`), one
    run per worker thread of the current pool (`core.parallel`); results in
    run order. Every worker makes its own buffers in `work`."""
    steps = spans(flat_base.numel(), chunk, flat_base.device)
    return run_on(
        lambda run: work(steps[run.start : run.stop]), len(steps), flat_base.device
    )


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
    _check_scales(tasks, scales)
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


def _has_negative_zero(values: torch.Tensor) -> bool:
    """Whether float32 `values` hold −0.0: its bits are int32's minimum
    (tensors without data, on the meta device, hold none)."""
    bits = values.view(torch.int32)
    if bits.numel() == 0 or bits.is_meta:
        return False
    return int(bits.min()) == torch.iinfo(torch.int32).min


def _sum_is_finite(values: torch.Tensor) -> bool:
    """Whether Σ values is finite: so is every value (a sum that overflows
    only says "look closer"); tensors without data count as finite."""
    return values.is_meta or bool(torch.isfinite(values.sum()))


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
    rows, _, _ = overlaps(base, tasks, epsilon, MERGE_CHUNK)
    return [
        float(scale_fn(index, torch.tensor(rows[index])) if scale is None else scale)
        for index, scale in enumerate(scales)
    ]


class _ChunkMerge:
    """One worker's buffers and steps for ram_merge_tensor, a chunk at a time.

    In float32: δ = Σ_t τ_t·m_t / max(c, 1) summed in task order (τ/c on the
    changed elements, as stock mergekit sums; a zero of either sign where
    c = 0, which leaves θ₀ + δ = θ₀ unless θ₀ is −0.0: `_signed_zeros`).
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
        like = dict(dtype=torch.float32, device=device)
        self.delta = torch.empty(width, **like)
        self.scratch = torch.empty(width, **like)
        self.factor = torch.empty(width, **like)
        self.changed = torch.empty(width, dtype=torch.bool, device=device)
        self.negative_zero = torch.tensor(-0.0, device=device)
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
            self._signed_zeros(tau, part.mask)
        delta = self._sum(tau)
        if not _sum_is_finite(delta):
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

    def _signed_zeros(self, tau: torch.Tensor, mask: torch.Tensor) -> None:
        """τ_t·m_t/c → exactly −0.0 where task t leaves the element unchanged.

        Only θ₀ = −0.0 tells the sign of a zero δ apart (x + ±0 = x for
        every other x, +0.0 included), so only chunks holding one pay for
        this; there the sum runs exactly as mergekit's does, −0.0 kept where
        c = 0, and an element whose terms cancel gets +0.0.
        """
        changed = self.changed[: tau.shape[1]]
        for row, row_mask in zip(tau, mask):
            torch.where(changed.copy_(row_mask), row, self.negative_zero, out=row)

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


# Up to this many tasks, one byte per element holds which tasks change it.
JOINT_LIMIT = 8


def overlaps(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    epsilon: float,
    chunk: int,
    *,
    checked: bool = False,
) -> tuple[list[list[int]], list[list[int]], bool | None]:
    """(histograms, intersections, finite) of one tensor group.

    histograms[t][k]: task t's changed elements that k other tasks change too;
    intersections[s][t] = |m_s ∧ m_t|; the diagonal is each task's changed
    count. Up to JOINT_LIMIT tasks the masks are made and counted `chunk`
    elements at a time (`joint_patterns`); beyond, every mask is computed
    once and kept as bool (one byte per element and task) for this tensor.
    `finite` (`checked`, up to JOINT_LIMIT tasks; else None): whether every
    τ was finite, which (with a task) holds exactly when base and tasks are,
    save where θ_t − θ₀ overflows float32.
    """
    if tasks and len(tasks) <= JOINT_LIMIT:
        joint, finite = joint_patterns(base, tasks, epsilon, chunk, checked=checked)
        return (*decode_joint(joint, len(tasks)), finite)
    base32 = base.to(dtype=torch.float32)
    return (*overlaps_of(change_masks(base32, tasks, epsilon), base32), None)


@torch.no_grad()
def joint_patterns(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    epsilon: float,
    chunk: int,
    *,
    checked: bool,
) -> tuple[list[int], bool | None]:
    """How many elements show each joint change pattern (bit t: task t's
    m = |τ_t| > ε) and (`checked`) whether every τ was finite; counted
    `chunk` elements at a time through ChunkReader on the current pool's
    workers (integer counts add up to the same totals in any order).

    The finiteness rides on one sum per chunk: NaN and ±Inf carry into it,
    and a sum that overflows only says "look closer" (checks.finite_inputs).
    """
    flat_base = base.reshape(-1)
    flat_tasks = [task.reshape(-1) for task in tasks]

    def count(steps: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max((stop - start for start, stop in steps), default=0)
        reader = ChunkReader(flat_base, flat_tasks, epsilon, width)
        codes = torch.empty(width, dtype=torch.float32, device=base.device)
        joint = torch.zeros(1 << len(tasks), dtype=torch.int64, device=base.device)
        total = torch.zeros((), dtype=torch.float32, device=base.device)
        summed = total if checked else None
        for start, stop in steps:
            part = reader.read(start, stop, counted=False, summed=summed)
            joint += pattern_counts(part.mask, codes[: stop - start], len(tasks))
        return joint, total

    results = chunked_walk(flat_base, chunk, count)
    joint = sum(part for part, _ in results).tolist()
    if not checked:
        return joint, None
    return joint, all(bool(torch.isfinite(total)) for _, total in results)


def pattern_counts(
    masks: Iterable[torch.Tensor], codes: torch.Tensor, n: int
) -> torch.Tensor:
    """How many elements show each of the 2^n joint patterns of `masks`
    (bit t: mask t; bool masks into uint8 `codes`, float32 ones into float32
    `codes`, the masks' size)."""
    codes.zero_()
    for t, mask in enumerate(masks):
        codes.add_(mask.view(torch.uint8) if mask.dtype == torch.bool else mask,
                   alpha=1 << t)  # fmt: skip
    if codes.is_floating_point():
        # On CPU float32 → int32 → uint8 costs a third of float32 → uint8.
        codes = codes.to(torch.int32).to(torch.uint8)
    return torch.bincount(codes, minlength=1 << n)


def overlaps_of(
    masks: Sequence[torch.Tensor], like: torch.Tensor
) -> tuple[list[list[int]], list[list[int]]]:
    """overlaps' (histograms, intersections) from masks already made."""
    if not masks:
        return [], []
    if len(masks) <= JOINT_LIMIT:
        return _from_joint(masks)
    counts = count_masks(masks, like)
    rows = [task_histogram(counts, mask, len(masks)).tolist() for mask in masks]
    pairs = [[0] * len(masks) for _ in masks]
    for s, mask in enumerate(masks):
        pairs[s][s] = sum(rows[s])
        for t in range(s + 1, len(masks)):
            pairs[s][t] = pairs[t][s] = int(
                torch.count_nonzero(torch.logical_and(mask, masks[t]))
            )
    return rows, pairs


def _from_joint(
    masks: Sequence[torch.Tensor],
) -> tuple[list[list[int]], list[list[int]]]:
    """overlaps' counts from one histogram of the masks' joint pattern.

    Bit t of an element's pattern says whether task t changes it; how many
    elements show each of the 2^N patterns determines every task's k-way
    histogram and every pairwise intersection, for one pass over a byte per
    element instead of one per task and pair.
    """
    codes = torch.empty(masks[0].numel(), dtype=torch.uint8, device=masks[0].device)
    flat = [mask.reshape(-1) for mask in masks]
    return decode_joint(pattern_counts(flat, codes, len(masks)).tolist(), len(masks))


def decode_joint(
    joint: Sequence[int], n: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Every task's k-way histogram and every pairwise intersection from the
    number of elements showing each joint pattern (bit t: task t changes it)."""
    rows = [[0] * n for _ in range(n)]
    pairs = [[0] * n for _ in range(n)]
    for code, elements in enumerate(joint):
        members = [t for t in range(n) if code >> t & 1]
        for s in members:
            rows[s][len(members) - 1] += elements
            for t in members:
                pairs[s][t] += elements
    return rows, pairs


def _check_scales(tasks: Sequence[torch.Tensor], scales: Sequence) -> None:
    if len(scales) != len(tasks):
        raise ValueError(f"{len(tasks)} task tensors but {len(scales)} scales")
