"""Does RAM+'s λ survive the output dtype? (docs/spec.md, same heading).

A unique element's rescale only reaches the written model if rounding to the
output dtype keeps θ₀ + λ·τ apart from θ₀ + τ. In bf16 most of RAM+'s small
λ − 1 rounds away; `SurvivalTally` counts, per task, the unique elements the
merge rescaled and how many of them the rescale still changes once written.
The merge kernel counts it from its own values (`core.kernel.ram_merge_tensor`,
`on_rescaled`): RAM's value of each chunk is rounded beside RAM+'s.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field

# Below this fraction of rescaled elements changed, a merge says its λ is lost.
MOSTLY_LOST = 0.5


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
