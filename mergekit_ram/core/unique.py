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

from mergekit_ram.core.kernel import overlap_counts, ram_merge_tensor

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
    """RAM's merge with the shared elements (c ≥ 2) replaced by `rule`;
    returns out_dtype (default: base's). Each element is rounded once: RAM's
    float32 value or the rule's. `kernel` holds ram_merge_tensor's scales,
    scale_fn and on_rescaled."""
    merged = ram_merge_tensor(
        base, tasks, epsilon=epsilon, out_dtype=out_dtype, **kernel
    )
    if not tasks:
        return merged
    base32 = base.to(dtype=torch.float32)
    shared = overlap_counts(base32, tasks, epsilon) >= 2
    if bool(shared.any()):
        merged[shared] = rule(base32, shared).to(dtype=merged.dtype)
    return merged


def unique_merge_tensor(
    base: torch.Tensor, tasks: Sequence[torch.Tensor], **options: Any
) -> torch.Tensor:
    """RAM with the base's value on shared elements (options as
    ram_then_shared's)."""
    return ram_then_shared(
        base, tasks, lambda base32, shared: base32[shared], **options
    )
