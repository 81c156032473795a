"""The RAM merge rule for one tensor (docs/spec.md, "Merge rule").

Everything is computed in float32 whatever the stored dtype, helper tensors live
on the inputs' device, inputs are never written, and task vectors are recomputed
per pass rather than stacked, so memory stays at a few float32 copies of one
tensor however many task models there are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Called with (task index, that task's k-way histogram in this tensor) when a
# task has no explicit scale; returns the scale for its unique elements.
ScaleFn = Callable[[int, torch.Tensor], float]
# Called with (task index, float32 base, τ, that task's unique elements, its
# scale) once per task, e.g. to count what the scale changes once rounded.
UniqueFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


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
    `out`: a bool tensor to write m into)."""
    return torch.gt(tau.abs_() if overwrite else tau.abs(), epsilon, out=out)


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


def count_masks(masks: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """c_i: how many masks are set at element i (uint8 below 256 masks).

    The one place masks are counted; `like` gives the shape and device when
    there are none.
    """
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


# Elements per step when λ is applied, so its scaled copy needs no full-size buffer.
_CHUNK = 1 << 20


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
    on_unique: UniqueFn | None = None,
) -> torch.Tensor:
    """Merge one tensor by the RAM rule; returns out_dtype (default: base's).

    The float32 result is rounded once, to the dtype that will be written.

    Unchanged elements keep θ₀, unique elements get θ₀ + λ_t·τ_t, shared ones
    θ₀ + Σ_active τ_t / c (the mean of the active task vectors, summed in task
    order as stock mergekit does, so λ = 1 reproduces it bit for bit). A task
    whose scale is None gets `scale_fn(index, histogram)` from this tensor's
    own counts (the tensor-local statistics scope).
    """
    _check_scales(tasks, scales)
    if not tasks:
        return base.to(dtype=out_dtype or base.dtype, copy=True)
    base32 = base.to(dtype=torch.float32)
    masks = change_masks(base32, tasks, epsilon)
    counts = count_masks(masks, base32)
    merged = merge_counted(
        base32,
        tasks,
        masks,
        counts,
        scales=scales,
        scale_fn=scale_fn,
        on_unique=on_unique,
    )
    return merged.to(dtype=out_dtype or base.dtype)


@torch.no_grad()
def merge_counted(
    base32: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    masks: list[torch.Tensor | None],
    counts: torch.Tensor,
    *,
    scales: Sequence[float | None],
    scale_fn: ScaleFn | None = None,
    on_unique: UniqueFn | None = None,
) -> torch.Tensor:
    """ram_merge_tensor's float32 result from masks and counts already made
    (change_masks, count_masks); each mask is dropped from `masks` once used.

    τ is recomputed into one reused buffer and every step runs in place, so
    the float32 working set is a few copies of the tensor. Dividing a unique
    element's τ by its count of 1 is exact, so τ/c followed by ×λ on unique
    elements equals the rule's two branches.
    """
    _check_scales(tasks, scales)
    # float32: dividing by an integer tensor is several times slower.
    divisor = counts.clamp(min=1).to(torch.float32)
    unique = counts == 1
    # -0.0 is the additive identity: an unchanged -0.0 keeps its sign bit.
    negative_zero = torch.tensor(-0.0, device=base32.device)
    delta = torch.full(base32.shape, -0.0, dtype=torch.float32, device=base32.device)
    tau = torch.empty_like(delta)
    for index, (task, scale) in enumerate(zip(tasks, scales)):
        mask = masks[index]
        masks[index] = None
        if scale is None:
            if scale_fn is None:
                raise ValueError(f"no scale for task {index} and no scale_fn")
            scale = scale_fn(index, task_histogram(counts, mask, len(tasks)))
        task_vector_into(tau, task, base32)
        if on_unique is not None:
            on_unique(index, base32, tau, unique & mask, scale)
        tau.div_(divisor)
        if scale != 1.0:
            _scale_unique(tau, unique, scale)
        delta += torch.where(mask, tau, negative_zero, out=tau)
        del mask
    del divisor, unique, tau
    return torch.add(base32, delta, out=delta)


def _check_scales(tasks: Sequence[torch.Tensor], scales: Sequence) -> None:
    if len(scales) != len(tasks):
        raise ValueError(f"{len(tasks)} task tensors but {len(scales)} scales")


def _scale_unique(tau: torch.Tensor, unique: torch.Tensor, scale: float) -> None:
    """τ ×= λ where `unique` (τ and `unique` contiguous), a chunk at a time."""
    flat, chosen = tau.view(-1), unique.view(-1)
    lam = torch.tensor(scale, dtype=torch.float32, device=tau.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK]
        torch.where(chosen[start : start + _CHUNK], part * lam, part, out=part)
