"""Unique elements only: the authors' `arm-unique` mode (`shared: base`).

Every shared element (c ≥ 2) keeps the base's value; unchanged elements keep
it too, and each unique element gets θ₀ + λ_t·τ_t as in RAM. With the chosen
task model's `unique_scale` set to the factor and every other task model's
to 0, this is the paper's Fig. 3 extraction: one agent's unique changes on
the base. The overlap counts still come from all task models listed, which is
what makes an element unique.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mergekit_ram.kernel import ScaleFn, UniqueFn, overlap_counts, ram_merge_tensor


def unique_merge_tensor(
    base: torch.Tensor,
    tasks: Sequence[torch.Tensor],
    *,
    epsilon: float,
    scales: Sequence[float | None],
    scale_fn: ScaleFn | None = None,
    out_dtype: torch.dtype | None = None,
    on_unique: UniqueFn | None = None,
) -> torch.Tensor:
    """RAM with the base's value on shared elements; returns out_dtype
    (default: base's), the float32 result rounded once."""
    merged = ram_merge_tensor(
        base,
        tasks,
        epsilon=epsilon,
        scales=scales,
        scale_fn=scale_fn,
        out_dtype=torch.float32,
        on_unique=on_unique,
    )
    base32 = base.to(dtype=torch.float32)
    shared = overlap_counts(base32, tasks, epsilon) >= 2
    return torch.where(shared, base32, merged).to(dtype=out_dtype or base.dtype)
