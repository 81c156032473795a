"""The RAM+ scale λ_t from a task's overlap counts (docs/spec.md, "RAM+ scale").

One rule for both statistics scopes: the global pass feeds it whole-model
totals, the kernel feeds it one tensor's counts. It never divides by zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Saturation = Literal["clip", "soft"]


@dataclass(frozen=True)
class ScaleRule:
    """λ = 1 + r·clip(S/U, 0, α) (clip, paper Eq. 6) or 1 + r·S/C (soft)."""

    r: float
    alpha: float
    saturation: Saturation = "clip"

    def scale(self, shared: int, unique: int) -> float:
        """λ for a task with `shared` shared and `unique` unique changed elements.

        C = 0 gives 1; U = 0 (λ never applied) gives the rule's limit.
        """
        changed = shared + unique
        if changed == 0:
            return 1.0
        if unique == 0:
            return self.limit()
        if self.saturation == "soft":
            return 1.0 + self.r * (shared / changed)
        return 1.0 + self.r * min(max(shared / unique, 0.0), self.alpha)

    def saturation_text(self) -> str:
        """'clip rule, alpha = 2', or 'soft rule': soft does not use alpha."""
        if self.saturation == "soft":
            return "soft rule"
        return f"clip rule, alpha = {self.alpha:g}"

    def limit(self) -> float:
        """λ as ρ → ∞: 1 + r·α for clip, 1 + r for soft."""
        return 1.0 + self.r * (1.0 if self.saturation == "soft" else self.alpha)
