"""The RAM merge rule for one tensor (RAM_SPEC.md, "Merge rule").

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


def task_vector_into(
    out: torch.Tensor, task: torch.Tensor, base32: torch.Tensor
) -> torch.Tensor:
    """τ = θ_t − θ₀ in float32, written into `out` (the inputs are untouched).

    The task is rounded to float32 first (exact for half precision), then the
    base subtracted; copying first is several times faster on CPU than a
    mixed-dtype subtraction and gives the same bits.
    """
    return out.copy_(task).sub_(base32)


@torch.no_grad()
def change_masks(
    base32: torch.Tensor, tasks: Sequence[torch.Tensor], epsilon: float
) -> list[torch.Tensor]:
    """m_t = |τ_t| > ε (strict, absolute) per task, via one reused float32 buffer."""
    scratch = torch.empty_like(base32)
    masks = []
    for task in tasks:
        task_vector_into(scratch, task, base32).abs_()
        masks.append(torch.gt(scratch, epsilon))
    return masks


def count_masks(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """c_i: how many masks are set at element i (uint8 up to 255 masks)."""
    dtype = torch.uint8 if len(masks) < 256 else torch.int32
    counts = torch.zeros(masks[0].shape, dtype=dtype, device=masks[0].device)
    for mask in masks:
        # A bool tensor viewed as bytes adds far faster than one promoted.
        counts += mask.view(torch.uint8) if dtype == torch.uint8 else mask
    return counts


def overlap_counts(
    base32: torch.Tensor, tasks: Sequence[torch.Tensor], epsilon: float
) -> torch.Tensor:
    """c_i: how many task models change element i."""
    return count_masks(change_masks(base32, tasks, epsilon))


def task_histogram(
    counts: torch.Tensor, mask: torch.Tensor, num_tasks: int
) -> torch.Tensor:
    """Entry k: this task's changed elements that exactly k other tasks change too."""
    # Elements outside the mask land in bin 0, which is dropped.
    masked = (counts * mask).flatten()
    if masked.dtype != torch.uint8:
        masked = masked.to(torch.int64)
    return torch.bincount(masked, minlength=num_tasks + 1)[1 : num_tasks + 1].cpu()


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
) -> torch.Tensor:
    """Merge one tensor by the RAM rule; returns base's dtype.

    Unchanged elements keep θ₀, unique elements get θ₀ + λ_t·τ_t, shared ones
    θ₀ + Σ_active τ_t / c (the mean of the active task vectors, summed in task
    order as stock mergekit does, so λ = 1 reproduces it bit for bit). A task
    whose scale is None gets `scale_fn(index, histogram)` from this tensor's
    own counts (the tensor-local statistics scope).

    Each mask is computed once; τ is recomputed into one reused buffer and
    every step runs in place, so the float32 working set is a few copies of
    the tensor. Dividing a unique element's τ by its count of 1 is exact, so
    τ/c followed by ×λ on unique elements equals the rule's two branches.
    """
    if len(scales) != len(tasks):
        raise ValueError(f"{len(tasks)} task tensors but {len(scales)} scales")
    if not tasks:
        return base.clone()
    base32 = base.to(dtype=torch.float32)
    masks = change_masks(base32, tasks, epsilon)
    counts = count_masks(masks)
    # float32: dividing by an integer tensor is several times slower.
    divisor = counts.clamp(min=1).to(torch.float32)
    unique = counts == 1
    # -0.0 is the additive identity: an unchanged -0.0 keeps its sign bit.
    negative_zero = torch.tensor(-0.0, device=base32.device)
    one = torch.tensor(1.0, device=base32.device)
    delta = torch.full_like(base32, -0.0)
    tau = torch.empty_like(base32)
    factor = None
    for index, (task, mask, scale) in enumerate(zip(tasks, masks, scales)):
        if scale is None:
            if scale_fn is None:
                raise ValueError(f"no scale for task {index} and no scale_fn")
            scale = scale_fn(index, task_histogram(counts, mask, len(tasks)))
        task_vector_into(tau, task, base32).div_(divisor)
        if scale != 1.0:
            factor = torch.empty_like(base32) if factor is None else factor
            lam = torch.tensor(scale, dtype=torch.float32, device=base32.device)
            tau.mul_(torch.where(unique, lam, one, out=factor))
        delta += torch.where(mask, tau, negative_zero, out=tau)
        masks[index] = None
    del masks, counts, divisor, unique, factor, tau
    return torch.add(base32, delta, out=delta).to(dtype=base.dtype)
