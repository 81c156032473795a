"""The scalar settings a global RAM+ merge needs, resolved once per merge."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.scale import ScaleRule

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
        cls, per_tensor: Iterable[tuple[str, Mapping[str, Any]]]
    ) -> MergeSettings:
        """Settings from resolved per-tensor values, which must all agree.

        Whole-model statistics use one epsilon and one λ rule for every tensor,
        so a filter or gradient that varies them per tensor is refused.
        """
        seen: dict[str, dict[Any, str]] = {key: {} for key in SCALAR_KEYS}
        for tensor, params in per_tensor:
            for key in SCALAR_KEYS:
                seen[key].setdefault(params[key], tensor)
        if not seen["r"]:
            raise ValueError("the merge has no tensors")
        key = varying_key(seen)
        if key is not None:
            (a, first), (b, second) = list(seen[key].items())[:2]
            raise one_value_error(
                key, f"is {a!r} for tensor {first} but {b!r} for {second}"
            )
        return cls(**{key: next(iter(seen[key])) for key in SCALAR_KEYS})

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


def one_value_error(key: str, values: str) -> RAMInputError:
    """A global-statistics setting that varies per tensor (config or plan time).

    `values` says how it varies, e.g. "is 0.1 for tensor A but 0.2 for B".
    """
    return RAMInputError(
        f"RAM parameter '{key}' {values}. Whole-model (global) statistics need "
        "one value for the whole merge: remove the per-tensor filter or gradient "
        f"on '{key}', or set statistics: tensor."
    )


def unique_scale_error(model: Any, values: str) -> RAMInputError:
    """A task model's explicit λ that varies per tensor (config or plan time)."""
    return RAMInputError(
        f"unique_scale for model {model} {values}. An explicit unique_scale "
        "replaces the whole-model λ, so it needs one value per model: remove its "
        "filter or gradient."
    )


def varying_key(values: Mapping[str, Collection[Any]]) -> str | None:
    """The rule "global statistics need one value for the whole merge".

    `values` maps each of SCALAR_KEYS to the distinct values it takes across
    the merge; returns the first key that takes several where some tensor
    needs whole-model statistics (statistics: global with r > 0), else None.
    """
    if "global" in values["statistics"] and any(r > 0 for r in values["r"]):
        for key in SCALAR_KEYS:
            if len(values[key]) > 1:
                return key
    return None
