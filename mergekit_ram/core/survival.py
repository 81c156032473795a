"""Does RAM+'s λ survive the output dtype? (docs/spec.md, same heading).

A unique element's rescale only reaches the written model if rounding to the
output dtype keeps θ₀ + λ·τ apart from θ₀ + τ. In bf16 most of RAM+'s small
λ − 1 rounds away; `SurvivalTally` counts, per task, the unique elements the
merge rescaled and how many of them the rescale still changes once written.
It rides on the merge kernel, which has τ, the unique mask and λ at hand.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

# Below this fraction of rescaled elements changed, a merge says its λ is lost.
MOSTLY_LOST = 0.5


# Elements per step: a few small buffers instead of gathered full-size copies.
_CHUNK = 1 << 18


def survivors(
    base32: torch.Tensor,
    tau: torch.Tensor,
    rescaled: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> int:
    """How many `rescaled` elements differ, written in `dtype`, between
    θ₀ + scale·τ and θ₀ + τ (both computed in float32, rounded once).

    A chunk at a time; a sparse chunk gathers its rescaled elements, a dense
    one computes all and counts the rescaled (gathering most of a chunk costs
    more than computing it whole).
    """
    flat_base, flat_tau = base32.reshape(-1), tau.reshape(-1)
    chosen = rescaled.reshape(-1)
    total = 0
    for start in range(0, chosen.numel(), _CHUNK):
        where = chosen[start : start + _CHUNK]
        count = int(torch.count_nonzero(where))
        if not count:
            continue
        base = flat_base[start : start + _CHUNK]
        step = flat_tau[start : start + _CHUNK]
        sparse = 4 * count < where.numel()
        if sparse:
            base, step = base[where], step[where]
        differs = (base + step * scale).to(dtype=dtype) != (base + step).to(dtype=dtype)
        total += int(torch.count_nonzero(differs if sparse else differs & where))
    return total


@dataclass
class SurvivalTally:
    """Per task: [unique elements rescaled (λ ≠ 1), of which changed once written].

    Merges of several tensors may run on several threads (mergekit's
    --multi-gpu); `add` is locked.
    """

    counts: dict[Hashable, list[int]] = field(default_factory=dict)
    dtypes: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, task: Hashable, rescaled: int, survived: int, dtype: str) -> None:
        with self._lock:
            entry = self.counts.setdefault(task, [0, 0])
            entry[0] += rescaled
            entry[1] += survived
            self.dtypes.add(dtype)

    def lost(self) -> bool:
        """Whether, over all tasks, under MOSTLY_LOST of the rescale survived."""
        rescaled = sum(entry[0] for entry in self.counts.values())
        survived = sum(entry[1] for entry in self.counts.values())
        return rescaled > 0 and survived < MOSTLY_LOST * rescaled

    def warning(self) -> str:
        """The one line a merge whose rescale is mostly lost prints."""
        rescaled = sum(entry[0] for entry in self.counts.values())
        survived = sum(entry[1] for entry in self.counts.values())
        written = "/".join(sorted(self.dtypes)) or "the output dtype"
        return (
            f"RAM+: only {survived:,} of {rescaled:,} rescaled unique elements "
            f"({100.0 * survived / max(rescaled, 1):.1f} %) differ from RAM once "
            f"written in {written}; set out_dtype: float32 to keep λ (the output "
            "is then twice the size of a bf16 one)."
        )
