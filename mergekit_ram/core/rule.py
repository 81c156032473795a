"""The RAM+ rule: λ_t from a task's overlap counts, the settings a global
merge resolves once, and whether λ survives the output dtype (docs/spec.md,
"RAM+ scale" and "Does RAM+'s λ survive the output dtype?").

One λ rule for both statistics scopes: the global pass feeds it whole-model
totals, the kernel one tensor's counts; it never divides by zero. In bf16 most
of RAM+'s small λ − 1 rounds away: `SurvivalTally` counts, per task, the unique
elements the merge rescaled and how many of them the rescale still changes
once written (the kernel's `on_rescaled`).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mergekit_ram.core.errors import RAMInputError

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
        if unique == 0:
            return self.limit() if shared else 1.0
        if self.saturation == "soft":
            return 1.0 + self.r * (shared / (shared + unique))
        return 1.0 + self.r * min(max(shared / unique, 0.0), self.alpha)

    def saturation_text(self) -> str:
        """'clip rule, alpha = 2', or 'soft rule': soft does not use alpha."""
        if self.saturation == "soft":
            return "soft rule"
        return f"clip rule, alpha = {self.alpha:g}"

    def limit(self) -> float:
        """λ as ρ → ∞: 1 + r·α for clip, 1 + r for soft."""
        return 1.0 + self.r * (1.0 if self.saturation == "soft" else self.alpha)


SCALAR_KEYS = ("epsilon", "r", "alpha", "saturation", "statistics")


@dataclass(frozen=True)
class MergeSettings:
    """epsilon, r, alpha, saturation and statistics as one merge uses them."""

    epsilon: float
    r: float
    alpha: float
    saturation: str
    statistics: str

    @classmethod
    def from_parameters(
        cls,
        per_tensor: Iterable[tuple[str, Mapping[str, Any]]],
        written: Mapping[str, str] | None = None,
    ) -> MergeSettings:
        """Settings from resolved per-tensor values, which must all agree.

        Whole-model statistics use one epsilon and one λ rule for every tensor,
        so a value that varies per tensor (per slice, filter or gradient) is
        refused, naming where the user wrote it (`written`: key → place).
        """
        seen: dict[str, dict[Any, str]] = {key: {} for key in SCALAR_KEYS}
        for tensor, params in per_tensor:
            for key in SCALAR_KEYS:
                seen[key].setdefault(params[key], tensor)
        if not seen["r"]:
            raise ValueError("the merge has no tensors")
        # r = 0 everywhere (RAM) or statistics: tensor: every tensor stands alone.
        if "global" in seen["statistics"] and any(r > 0 for r in seen["r"]):
            for key, values in seen.items():
                if len(values) > 1:
                    (a, first), (b, second) = list(values.items())[:2]
                    place = (written or {}).get(key)
                    raise RAMInputError(
                        f"RAM parameter '{key}' is {a!r} for tensor {first} but "
                        f"{b!r} for {second}{f' (set at {place})' if place else ''}"
                        ". Whole-model (global) statistics need one value for the "
                        f"whole merge: give '{key}' one value in the top-level "
                        "parameters (none per slice, no filter or gradient), or "
                        "set statistics: tensor."
                    )
        return cls(**{key: next(iter(values)) for key, values in seen.items()})

    @property
    def rule(self) -> ScaleRule:
        return ScaleRule(r=self.r, alpha=self.alpha, saturation=self.saturation)

    def needs_pass(
        self, tasks: Iterable[Hashable], explicit: Mapping[Hashable, float | None]
    ) -> bool:
        """True when some task's λ must come from whole-model statistics."""
        if self.statistics != "global" or self.r == 0:
            return False
        return any(explicit.get(task) is None for task in tasks)

    def as_dict(self) -> dict:
        return {key: getattr(self, key) for key in SCALAR_KEYS}


def unique_scale_error(model: Any, values: str) -> RAMInputError:
    """A task model's explicit λ that varies per tensor (config or plan time)."""
    return RAMInputError(
        f"unique_scale for model {model} {values}. An explicit unique_scale "
        "replaces the whole-model λ, so it needs one value per model: remove its "
        "filter or gradient."
    )


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
            before, kept = self.counts.get(task, (0, 0))
            self.counts[task] = [before + rescaled, kept + survived]
            self.dtypes.add(dtype)

    def lost(self) -> bool:
        """Whether, over all tasks, under MOSTLY_LOST of the rescale survived."""
        rescaled, survived = map(sum, zip([0, 0], *self.counts.values()))
        return rescaled > 0 and survived < MOSTLY_LOST * rescaled

    def warning(self) -> str:
        """The one line a merge whose rescale is mostly lost prints."""
        rescaled, survived = map(sum, zip([0, 0], *self.counts.values()))
        written = "/".join(sorted(self.dtypes)) or "the output dtype"
        return (
            f"RAM+: only {survived:,} of {rescaled:,} rescaled unique elements "
            f"({100.0 * survived / max(rescaled, 1):.1f} %) differ from RAM once "
            f"written in {written}; set out_dtype: float32 to keep λ (the output "
            "is then twice the size of a bf16 one)."
        )
