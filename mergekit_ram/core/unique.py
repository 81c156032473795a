"""Unique elements only: the authors' `arm-unique` mode (`shared: base`).

Every shared element (c ≥ 2) keeps the base's value; unchanged elements keep
it too, and each unique element gets θ₀ + λ_t·τ_t as in RAM. With the chosen
task model's `unique_scale` set to the factor and every other task model's
to 0, this is the paper's Fig. 3 extraction: one agent's unique changes on
the base. The overlap counts still come from all task models listed, which is
what makes an element unique.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mergekit_ram.core.kernel import (
    change_masks,
    count_masks,
    merge_counted,
    ram_merge_tensor,
)

# (float32 base, mask of the shared elements) -> their values, flat.
SharedRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def ram_then_shared(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    rule: SharedRule,
    *,
    epsilon: float,
    out_dtype: torch.dtype | None = None,
    **kernel: Any,
) -> torch.Tensor:
    """RAM's float32 merge with the shared elements (c ≥ 2) replaced by
    `rule`; returns out_dtype (default: base's), rounded once. `kernel` holds
    ram_merge_tensor's scales, scale_fn and on_unique."""
    if not tasks:
        return ram_merge_tensor(
            base, tasks, epsilon=epsilon, out_dtype=out_dtype, **kernel
        )
    base32 = base.to(dtype=torch.float32)
    masks = change_masks(base32, tasks, epsilon)
    counts = count_masks(masks, base32)
    shared = counts >= 2
    merged = merge_counted(base32, tasks, masks, counts, **kernel)
    del masks, counts
    if bool(shared.any()):
        merged[shared] = rule(base32, shared)
    return merged.to(dtype=out_dtype or base.dtype)


def unique_merge_tensor(
    base: torch.Tensor, tasks: Sequence[torch.Tensor], **options: Any
) -> torch.Tensor:
    """RAM with the base's value on shared elements (options as
    ram_then_shared's)."""
    return ram_then_shared(
        base, tasks, lambda base32, shared: base32[shared], **options
    )
