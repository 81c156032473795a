"""Shared-region TIES: the authors' `arm-ties` mode (`shared: ties`).

Unchanged and unique elements follow RAM (unique ones with the task's λ); only
the shared elements (c ≥ 2) of each tensor are merged differently, by TIES
restricted to them, exactly as the authors' script does it:

- the region has n elements; k = int((1 − density)·n). Task t keeps the
  region's elements where |τ_t·m_t| is at least its k-th smallest |τ_t·m_t|
  over the region (ties at the threshold stay); with k < 1 nothing is trimmed;
- each element elects a sign by total mass (sum of the kept
  positive values against the sum of the kept negative magnitudes; equal
  masses elect nothing), and gets the mean of the kept non-zero values of
  that sign, summed in task order; an element with none keeps the base.

Their script also falls back to the RAM mean where trimming keeps nothing
non-zero in the whole region. That cannot happen: a shared element is changed
by at least two tasks, so each of them has a non-zero value in the region, and
its largest magnitude is never below its own k-th smallest. No such branch
here, and tests/test_core_ties.py checks the argument on its edge cases.

Memory stays at a few float32 copies of one tensor: τ is recomputed per pass
rather than stacked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mergekit_ram.core.kernel import change_mask, task_vector
from mergekit_ram.core.unique import ram_then_shared


def _region_values(
    task: torch.Tensor, base32: torch.Tensor, shared: torch.Tensor, epsilon: float
) -> torch.Tensor:
    """τ·m of one task on the shared elements, flattened (0 where unchanged)."""
    tau = task_vector(task, base32)[shared]
    return torch.where(change_mask(tau, epsilon), tau, 0.0)


def _trimmed(values: torch.Tensor, k: int) -> torch.Tensor:
    """values where |value| ≥ its k-th smallest magnitude, else 0 (k < 1: all)."""
    if k < 1:
        return values
    magnitude = values.abs()
    threshold = torch.kthvalue(magnitude, k).values
    return torch.where(magnitude >= threshold, values, 0.0)


def ties_shared_delta(
    base32: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    shared: torch.Tensor,
    *,
    epsilon: float,
    density: float,
) -> torch.Tensor:
    """The TIES delta on the shared elements (flat, in `shared`'s order)."""
    k = int((1.0 - density) * int(shared.sum()))
    positive = torch.zeros(int(shared.sum()), device=base32.device)
    negative = torch.zeros_like(positive)
    for task in tasks:
        kept = _trimmed(_region_values(task, base32, shared, epsilon), k)
        positive += kept.clamp(min=0)
        negative += (-kept).clamp(min=0)
    total = torch.zeros_like(positive)
    kept_count = torch.zeros_like(positive)
    for task in tasks:
        kept = _trimmed(_region_values(task, base32, shared, epsilon), k)
        agree = ((kept > 0) & (positive > negative)) | (
            (kept < 0) & (negative > positive)
        )
        total += torch.where(agree, kept, 0.0)
        kept_count += agree
    return total / kept_count.clamp(min=1)


def ties_merge_tensor(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    *,
    epsilon: float,
    density: float,
    **options: Any,
) -> torch.Tensor:
    """RAM with shared-region TIES on the shared elements (other options as
    unique.ram_then_shared's); the float32 result rounded once."""

    def rule(base32: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return base32[shared] + ties_shared_delta(
            base32, tasks, shared, epsilon=epsilon, density=density
        )

    return ram_then_shared(base, tasks, rule, epsilon=epsilon, **options)
