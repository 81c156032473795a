"""The RAM merge rule for one tensor (docs/spec.md, "Merge rule").

Everything is computed in float32 whatever the stored dtype, helper tensors live
on the inputs' device, inputs are never written, and task vectors are recomputed
per pass rather than stacked, so memory stays at a few float32 copies of one
tensor however many task models there are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

# Called with (task index, that task's k-way histogram in this tensor) when a
# task has no explicit scale; returns the scale for its unique elements.
ScaleFn = Callable[[int, torch.Tensor], float]
# Called with (task index, float32 base, τ, that task's unique elements, its
# scale) once per task, e.g. to count what the scale changes once rounded.
UniqueFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


def task_vector(task: torch.Tensor, base32: torch.Tensor) -> torch.Tensor:
    """τ = θ_t − θ₀ in float32 (a fresh tensor; the inputs are untouched)."""
    return task.to(dtype=torch.float32) - base32


def change_mask(tau: torch.Tensor, epsilon: float) -> torch.Tensor:
    """m = |τ| > ε, strict and absolute."""
    return tau.abs() > epsilon


def count_changes(masks: Iterable[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """c_i: how many of the change masks are set at element i (int32).

    The one place masks are counted; `masks` may be a generator, so only one
    mask need exist at a time.
    """
    counts = torch.zeros(like.shape, dtype=torch.int32, device=like.device)
    for mask in masks:
        counts += mask
    return counts


def overlap_counts(
    base32: torch.Tensor, tasks: Sequence[torch.Tensor], epsilon: float
) -> torch.Tensor:
    """c_i: how many task models change element i."""
    return count_changes(
        (change_mask(task_vector(task, base32), epsilon) for task in tasks), base32
    )


def task_histogram(
    counts: torch.Tensor, mask: torch.Tensor, num_tasks: int
) -> torch.Tensor:
    """Entry k: this task's changed elements that exactly k other tasks change too."""
    return torch.bincount(
        (counts[mask] - 1).to(torch.int64).flatten(), minlength=num_tasks
    )[:num_tasks].cpu()


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
    if len(scales) != len(tasks):
        raise ValueError(f"{len(tasks)} task tensors but {len(scales)} scales")
    if not tasks:
        return base.to(dtype=out_dtype or base.dtype, copy=True)
    base32 = base.to(dtype=torch.float32)
    counts = overlap_counts(base32, tasks, epsilon)
    divisor = counts.clamp(min=1).to(torch.float32)
    unique = counts == 1
    # -0.0 is the additive identity: an unchanged -0.0 keeps its sign bit.
    delta = torch.full_like(base32, -0.0)
    for index, (task, scale) in enumerate(zip(tasks, scales)):
        tau = task_vector(task, base32)
        mask = change_mask(tau, epsilon)
        if scale is None:
            if scale_fn is None:
                raise ValueError(f"no scale for task {index} and no scale_fn")
            scale = scale_fn(index, task_histogram(counts, mask, len(tasks)))
        if on_unique is not None:
            on_unique(index, base32, tau, unique & mask, scale)
        contribution = torch.where(unique, tau * scale, tau / divisor)
        delta += torch.where(mask, contribution, -0.0)
        del tau, mask, contribution
    return (base32 + delta).to(dtype=out_dtype or base.dtype)
