"""The RAM merge rule for one tensor, and the one count walk (docs/spec.md).

Everything is computed in float32 whatever the stored dtype, helper tensors live
on the inputs' device and inputs are never written. The merge and the count
walk a tensor a chunk at a time through `chunked_walk` (so both apply the same
τ and change mask), on the threads of `core.parallel`: nothing tensor-sized is
allocated besides the output, however many task models there are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mergekit_ram.core.parallel import T, workers


def task_vector(task: Tensor, base32: Tensor, out: Tensor | None = None) -> Tensor:
    """τ = θ_t − θ₀ in float32, into `out` (else a new tensor); the inputs
    are untouched.

    The task is rounded to float32 first (exact for half precision), then the
    base subtracted; copying first is several times faster on CPU than a
    mixed-dtype subtraction and gives the same bits.
    """
    out = torch.empty_like(base32) if out is None else out
    return out.copy_(task).sub_(base32)


def change_mask(tau: Tensor, epsilon: float) -> Tensor:
    """m = |τ| > ε, strict and absolute (a NaN τ is unchanged)."""
    return tau.abs() > epsilon


@torch.no_grad()
def overlap_counts(base32: Tensor, tasks: Sequence[Tensor], epsilon: float) -> Tensor:
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


# One worker's reader of a tensor group: read(start, stop, counted=True) gives
# θ₀, τ (a row per task), m (1.0 / 0.0) and (`counted`) c of elements
# [start, stop), all float32, overwriting the last chunk read.
Reader = Callable[..., tuple[Tensor, ...]]


def chunked_walk(
    base: Tensor,
    tasks: Sequence[Tensor],
    epsilon: float,
    chunk: int,
    work: Callable[[Reader, Tensor, Tensor, list], T],
    *,
    extra: tuple[int, int] = (0, 0),
    exact: bool = False,
) -> list[T]:
    """`work(read, taus, masks, steps)` on contiguous runs of the (start, stop)
    steps over the tensor group, one run per worker thread of the current pool
    (`core.parallel`), each with float32 rows of its own, which `taus` and
    `masks` (the rows `read` writes τ and m into) expose with `extra` more
    rows below the tasks' for `work`; results in run order. A step is `chunk`
    elements on CPU, at least DEVICE_CHUNK elsewhere unless `exact` (float
    sums that depend on where the chunks end).

    Masks are float32 (`change_mask`'s rule): counted, multiplied into τ and
    multiplied together by arithmetic, which on CPU costs a fraction of the
    same work on bool.
    """
    flat_base, flat_tasks = base.reshape(-1), [task.reshape(-1) for task in tasks]
    total, device, n = flat_base.numel(), flat_base.device, len(tasks)
    size = chunk if device.type == "cpu" or exact else max(chunk, DEVICE_CHUNK)

    def run(starts: Tensor) -> T:
        steps = [(s, min(s + size, total)) for s in starts.tolist()]
        width = max((stop - start for start, stop in steps), default=0)
        like: dict[str, Any] = dict(dtype=torch.float32, device=device)
        base32, counts = torch.empty((2, width), **like)
        taus = torch.empty((n + extra[0], width), **like)
        masks = torch.empty((n + extra[1], width), **like)

        def read(start: int, stop: int, counted: bool = True) -> tuple:
            width = stop - start
            chunk_base = base32[:width].copy_(flat_base[start:stop])
            tau, mask = taus[:n, :width], masks[:n, :width]
            for row, task in zip(tau, flat_tasks):
                task_vector(task[start:stop], chunk_base, out=row)
            # m = |τ| > ε as 1.0 / 0.0, |τ| held in the mask's rows on the
            # way: on CPU a comparison written to float32 costs a fraction of
            # one written to bool.
            torch.gt(torch.abs(tau, out=mask), epsilon, out=mask)
            # Exact: sums of 0 / 1; a few rows add faster one by one.
            if counted and 0 < n <= 4:
                _sum(mask, counts[:width])
            elif counted:
                torch.sum(mask, 0, out=counts[:width])
            return chunk_base, tau, mask, counts[:width]

        return work(read, taus, masks, steps)

    with workers() as pool:  # the merge's, or one for this call
        return pool.split(run, torch.arange(0, total, size), device)


# The signed integer type of each float width: written values compare by
# their bits.
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# −0.0's bits as int32: the smallest int32.
_ZERO = torch.iinfo(torch.int32).min


# No autograd: weights that require grad (module inputs) merge as plain data,
# and the in-place steps with out= would otherwise be refused.
@torch.no_grad()
def ram_merge_tensor(
    base: Tensor,
    tasks: Sequence[Tensor],
    *,
    epsilon: float,
    scales: Sequence[float | None],
    scale_fn: Callable[[int, Tensor], float] | None = None,
    out_dtype: torch.dtype | None = None,
    on_rescaled: Callable[[int, int, int], None] | None = None,
    on_nonfinite: Callable[[], None] | None = None,
) -> Tensor:
    """Merge one tensor by the RAM rule; returns out_dtype (default: base's).

    The float32 result is rounded once, to the dtype that will be written.

    Unchanged elements keep θ₀, unique elements get θ₀ + λ_t·τ_t, shared ones
    θ₀ + Σ_active τ_t / c (the mean of the active task vectors, summed in task
    order as stock mergekit does, so λ = 1 reproduces it bit for bit). A task
    whose scale is None gets `scale_fn(index, histogram)` from this tensor's
    own counts (its k-way histogram: the tensor-local statistics scope; one
    more read of the inputs). `on_rescaled(index, rescaled, survived)` hears,
    for each task with λ ≠ 1, how many unique elements it rescaled and how
    many of those still differ from RAM's value once written. Callers refuse
    or replace non-finite inputs (the `nonfinite` rule): first, or,
    refusing, after the walk, which calls `on_nonfinite` when some chunk's
    sum of τ was not finite (every τ is finite otherwise; an overflowing sum
    only says "look closer"), so the inputs need no read of their own. A τ
    that is NaN (a non-finite base, which `nonfinite: ignore` hands on with
    every task's value there replaced by it) counts as unchanged, as in the
    count, so such an element keeps the base's value.
    """
    if len(scales) != len(tasks):
        raise ValueError(f"{len(tasks)} task tensors but {len(scales)} scales")
    written = out_dtype or base.dtype
    if not tasks:
        return base.to(dtype=written, copy=True)
    if None in scales:  # this tensor's histograms, counted before any merging
        rows = overlaps(base, tasks, epsilon, MERGE_CHUNK)[0]
        scales = [
            scale_fn(index, torch.tensor(rows[index])) if scale is None else scale
            for index, scale in enumerate(scales)
        ]
    # λ as float32 holds it (the plan refuses one beyond float32's range).
    factors = torch.tensor(scales, dtype=torch.float32).tolist()
    rescales = any(scale != 1.0 for scale in scales)
    tally = on_rescaled is not None and rescales
    out = torch.empty(base.numel(), dtype=written, device=base.device)

    def merge(read: Reader, taus: Tensor, _: Tensor, steps: list) -> tuple:
        """In float32: δ = Σ_t τ_t·m_t / max(c, 1) summed in task order (τ/c
        on the changed elements, as stock mergekit sums; a zero of either
        sign where c = 0). RAM+ multiplies δ by Λ = λ_t on task t's unique
        elements and 1 elsewhere, which is exact (δ = τ_t there; x·1 = x),
        and θ₀ + δ is rounded into the output. With `tally` it also rounds
        θ₀ + δ before Λ (RAM's value) and counts, per task, its unique
        elements and those whose written bits differ."""
        width = taus.shape[1]
        like: dict[str, Any] = dict(dtype=torch.float32, device=base.device)
        delta, scratch, lam = (torch.empty(width, **like) for _ in range(3))
        # Row 0: 1.0 on unique elements (c = 1); row 1: 1.0 where RAM+ and
        # RAM are written apart.
        rows = torch.empty((2, width), **like)
        plain = torch.empty(width, dtype=written, device=base.device)
        found = torch.zeros((2, len(tasks)), dtype=torch.float64, device=base.device)
        doubtful = False  # some chunk's Σ τ was not finite
        for start, stop in steps:
            width = stop - start
            base32, tau, mask, counts = read(start, stop)
            divisor = torch.clamp(counts, min=1, out=scratch[:width])
            summed = _sum(tau.mul_(mask), delta[:width], divisor)
            if not (finite := summed.is_meta or math.isfinite(summed.sum())):
                # A τ that is NaN or ±∞ (NaN·0 where its mask is 0 included):
                # refusing, the caller checks the inputs; ignoring, it is a
                # non-finite base's, and that task leaves the element
                # unchanged, as mergekit's where() has it; ±∞ stays.
                doubtful = True
                torch.nan_to_num_(tau, nan=0.0, posinf=math.inf, neginf=-math.inf)
            # θ₀ holds −0.0 (meta tensors hold no data).
            signed = not base32.is_meta and int(base32.view(torch.int32).min()) == _ZERO
            if signed:
                # Only θ₀ = −0.0 tells the sign of a zero δ apart (x + ±0 = x
                # otherwise): there a task leaving an element unchanged adds
                # exactly −0.0, as mergekit's where() has it.
                tau.masked_fill_(mask == 0, -0.0)
            if signed or not finite:
                summed = _sum(tau, delta[:width], divisor)
            if rescales:
                # Λ = (1 − u) + Σ_t λ_t·m_t·u: exact, every product is by 0 or
                # 1 and at most one term is not 0.
                unique = torch.eq(counts, 1, out=rows[0, :width])
                factor = torch.ne(counts, 1, out=lam[:width])
                for row, scale in zip(mask, factors):
                    factor.addcmul_(row, unique, value=scale)
                if tally:
                    plain[:width].copy_(torch.add(base32, summed, out=scratch[:width]))
                summed.mul_(factor)
            written_part = out[start:stop].copy_(summed.add_(base32))
            if tally:
                bits = _BITS[out.element_size()]
                apart = plain[:width].view(bits), written_part.view(bits)
                torch.ne(*apart, out=rows[1, :width])
                # Sums of 0 / 1 over one chunk: exact in float32.
                found += torch.mm(rows[:, :width], mask.T)
        return found, doubtful

    walked = chunked_walk(base, tasks, epsilon, MERGE_CHUNK, merge)
    if on_nonfinite is not None and any(doubtful for _, doubtful in walked):
        on_nonfinite()
    if tally:
        rescaled, survived = sum(found for found, _ in walked).tolist()
        for index in (i for i, scale in enumerate(scales) if scale != 1.0):
            on_rescaled(index, int(rescaled[index]), int(survived[index]))
    return out.view(base.shape)


def _sum(rows: Tensor, out: Tensor, divisor: Tensor | None = None) -> Tensor:
    """Σ_t rows_t, in task order, into `out`; with `divisor`, Σ_t rows_t /
    divisor, each quotient rounded before it is added (as dividing the rows
    first would have it), in one pass per row."""
    if divisor is not None:
        torch.div(rows[0], divisor, out=out)
        for row in rows[1:]:
            out.addcdiv_(row, divisor)
        return out
    torch.add(rows[0], rows[1], out=out) if len(rows) > 1 else out.copy_(rows[0])
    for row in rows[2:]:
        out.add_(row)
    return out


# Up to this many tasks, one code per element holds which tasks change it.
JOINT_LIMIT = 8


@torch.no_grad()
def overlaps(
    base: Tensor,
    tasks: Sequence[Tensor],
    epsilon: float,
    chunk: int,
    each: Callable[[Tensor, Tensor], T] | None = None,
) -> tuple[list[list[int]], list[list[int]], bool, list]:
    """(histograms, intersections, finite, each's results) of one tensor
    group, from one walk over it `chunk` elements a step.

    histograms[t][k]: task t's changed elements that exactly k other tasks
    change too; intersections[s][t] = |m_s ∧ m_t| (the diagonal: each task's
    changed count). Per chunk, up to JOINT_LIMIT tasks, one histogram of the
    masks' joint pattern (bit t: task t changes the element; the patterns of
    `pack` elements counted as one number) determines both;
    beyond, one product of the masks with [masks; c = 1 … c = N] counts them
    (sums of 0 / 1, exact in float32). `finite`: whether every τ was finite,
    which (with a task) holds exactly when base and tasks are, save where
    θ_t − θ₀ overflows float32; it rides on one sum per chunk (NaN and ±∞
    carry into it, an overflowing sum only says "look closer":
    checks.finite_inputs). `each` (inner products) runs on every chunk, with
    a (2N+1, width) float32 block holding the chunk's τ in its first N rows
    (the rest is its own) and c; its
    results come back in chunk order, the chunks ending where they would on
    one thread, so float sums over them do not depend on the workers.
    """
    n, joint, inner = len(tasks), len(tasks) <= JOINT_LIMIT, each is not None
    # A chunk as `pack` pieces: number i is Σ_j p_j·2^(jN), p_j = Σ_t m_t·2^t
    # the pattern of piece j's element i, all from one matrix-vector product
    # (exact at any matmul precision: 0 / 1 times powers of two, summed below
    # 2^12); bincount, whose cost is per number, counts `pack` patterns a
    # number in at most 2^12 bins. A power of two: every chunk but a run's
    # last divides into pieces in place. Small tensors do not repay summing
    # the pieces' histograms. Beyond JOINT_LIMIT nothing is packed, and no
    # histogram of 2^N patterns is allocated.
    packs = joint and base.numel() >> 16
    pack = 1 << (12 // max(n, 1)).bit_length() - 1 if packs else 1
    bins = 1 << n * pack if joint else 0
    weights = [1 << t + n * j for t in range(n) for j in range(pack)]
    weights = torch.tensor(weights, dtype=torch.float32, device=base.device)

    def count(read: Reader, taus: Tensor, masks: Tensor, steps: list) -> tuple:
        shape = (bins,) if joint else (n, 2 * n)
        found = torch.zeros(shape, dtype=torch.int64, device=base.device)
        rest = torch.zeros(bins and 1 << n, dtype=torch.int64, device=base.device)
        summed = torch.zeros((), dtype=torch.float32, device=base.device)
        results = []
        for start, stop in steps:
            _, tau, changed, counts = read(start, stop, inner or not joint)
            summed += tau.sum()
            width = stop - start
            if joint and changed.is_contiguous() and width % pack == 0:
                block = changed.view(n * pack, width // pack)
                packed = torch.mv(block.T, weights).to(torch.int32)
                found += torch.bincount(packed, minlength=bins)
            elif joint:  # one pattern a number
                codes = torch.mv(changed.T, weights[::pack]).to(torch.int32)
                rest += torch.bincount(codes, minlength=1 << n)
            else:
                rows = masks[:, :width]
                for k, row in enumerate(rows[n:], 1):
                    torch.eq(counts, k, out=row)
                found += torch.mm(changed, rows.T).to(torch.int64)
            if inner:
                results.append(each(taus[:, :width], counts))
        return found, rest, summed, results

    extra = (n + 1 if each else 0, 0 if joint else n)
    walked = chunked_walk(base, tasks, epsilon, chunk, count, extra=extra, exact=inner)
    found = sum(part for part, *_ in walked)
    if joint:  # each field's histogram of the packed numbers, and the rest
        fields, found = found.view(1, *(1 << n,) * pack), sum(r for _, r, *_ in walked)
        for field in range(1, pack + 1):
            found += fields.sum([d for d in range(pack + 1) if d != field])
    found = found.tolist()
    finite = all(math.isfinite(summed) for _, _, summed, _ in walked)
    results = [result for *_, part in walked for result in part]
    if joint:  # every task's histogram and intersections from the patterns
        found, patterns = [[0] * 2 * n for _ in range(n)], found
        for code, elements in enumerate(patterns):
            members = [t for t in range(n) if code >> t & 1]
            for s in members:
                found[s][n + len(members) - 1] += elements
                for t in members:
                    found[s][t] += elements
    return [row[n:] for row in found], [row[:n] for row in found], finite, results
