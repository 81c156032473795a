"""The authors' modes for the shared elements (c ≥ 2): `shared: ties` and
`shared: base` (docs/spec.md). Unchanged and unique elements follow RAM
(unique ones with the task's λ); only the shared elements are replaced.

`shared: base` (their `arm-unique`): every shared element keeps the base's
value. With the chosen task model's `unique_scale` set to the factor and every
other task model's to 0, this is the paper's Fig. 3 extraction: one agent's
unique changes on the base. The overlap counts still come from all task models
listed, which is what makes an element unique.

`shared: ties` (their `arm-ties`): TIES restricted to the shared elements,
exactly as the authors' script does it:

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
here, and tests/test_core_modes.py checks the argument on its edge cases.

Memory stays at a few float32 copies of one tensor: τ is recomputed per pass
rather than stacked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mergekit_ram.core import kernel

# (float32 base, mask of the shared elements) -> their values, flat.
SharedRule = Callable[[Tensor, Tensor], Tensor]


def ram_then_shared(
    base: Tensor,
    tasks: Sequence[Tensor],
    rule: SharedRule,
    *,
    epsilon: float,
    **options: Any,
) -> Tensor:
    """RAM's merge with the shared elements (c ≥ 2) replaced by `rule`;
    returns out_dtype (default: base's). Each element is rounded once: RAM's
    float32 value or the rule's. `options` holds ram_merge_tensor's scales,
    scale_fn, out_dtype and on_rescaled."""
    merged = kernel.ram_merge_tensor(base, tasks, epsilon=epsilon, **options)
    base32 = base.to(dtype=torch.float32)
    shared = kernel.overlap_counts(base32, tasks, epsilon) >= 2
    if bool(shared.any()):
        merged[shared] = rule(base32, shared).to(dtype=merged.dtype)
    return merged


def unique_merge_tensor(
    base: Tensor, tasks: Sequence[Tensor], **options: Any
) -> Tensor:
    """RAM with the base's value on shared elements (options as
    ram_then_shared's)."""
    return ram_then_shared(base, tasks, lambda b, shared: b[shared], **options)


def _trimmed(values: Tensor, k: int) -> Tensor:
    """values where |value| ≥ its k-th smallest magnitude, else 0 (k < 1: all)."""
    if k < 1:
        return values
    magnitude = values.abs()
    threshold = torch.kthvalue(magnitude, k).values
    return torch.where(magnitude >= threshold, values, 0.0)


def ties_merge_tensor(
    base: Tensor,
    tasks: Sequence[Tensor],
    *,
    epsilon: float,
    density: float,
    **options: Any,
) -> Tensor:
    """RAM with shared-region TIES on the shared elements (other options as
    ram_then_shared's); the float32 result rounded once."""

    def rule(base32: Tensor, shared: Tensor) -> Tensor:
        n = int(shared.sum())
        k = int((1.0 - density) * n)

        def kept(task: Tensor) -> Tensor:
            """τ·m of one task on the shared elements, flat, trimmed."""
            tau = kernel.task_vector(task, base32)[shared]
            return _trimmed(torch.where(kernel.change_mask(tau, epsilon), tau, 0.0), k)

        positive, negative, total, count = torch.zeros((4, n), device=base32.device)
        for task in tasks:
            values = kept(task)
            positive += values.clamp(min=0)
            negative += (-values).clamp(min=0)
        for task in tasks:
            values = kept(task)
            agree = (values > 0) & (positive > negative)
            agree |= (values < 0) & (negative > positive)
            total += torch.where(agree, values, 0.0)
            count += agree
        return base32[shared] + total / count.clamp(min=1)

    return ram_then_shared(base, tasks, rule, epsilon=epsilon, **options)
