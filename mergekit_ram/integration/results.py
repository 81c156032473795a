"""What a RAM+ merge leaves behind: ram_statistics.json and the model card
(its RAM+ section, and its model list in the configuration's order)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration

from mergekit_ram.core.counting import OverlapStatistics
from mergekit_ram.core.settings import MergeSettings
from mergekit_ram.core.survival import SurvivalTally
from mergekit_ram.integration.config_groups import groups
from mergekit_ram.integration.model_locations import model_references
from mergekit_ram.integration.tables import markdown_table, percent

STATISTICS_FILE = "ram_statistics.json"


def task_rows(
    stats: OverlapStatistics, scales: Mapping[Hashable, float]
) -> list[dict[str, Any]]:
    """Per task: model, changed, shared, unique, overlap_histogram, rho, scale.

    rho is null when the task has shared but no unique elements (ρ = ∞).
    """
    rows = []
    for task, counts in stats.tasks.items():
        rho = counts.rho
        rows.append(
            {
                "model": str(task),
                "elements": counts.elements,
                "changed": counts.changed,
                "shared": counts.shared,
                "unique": counts.unique,
                "overlap_histogram": list(counts.histogram),
                "rho": rho if math.isfinite(rho) else None,
                "scale": scales.get(task, 1.0),
            }
        )
    return rows


def statistics_document(
    settings: MergeSettings,
    stats: OverlapStatistics,
    scales: Mapping[Hashable, float],
) -> dict[str, Any]:
    """The content of ram_statistics.json."""
    return {
        **settings.as_dict(),
        "num_tensors": stats.num_tensors,
        "num_elements": stats.num_elements,
        "seconds": round(stats.seconds, 3),
        "tasks": task_rows(stats, scales),
    }


def with_survival(
    document: dict[str, Any], tally: SurvivalTally | None
) -> dict[str, Any]:
    """ram_statistics.json's content plus, per task, how many unique elements
    were rescaled (λ ≠ 1) and how many of them still differ from RAM once
    written (`rescale_survived`); both 0 when nothing was rescaled. With no
    tally nothing was counted (analyze merges nothing; a merge whose λ are all
    1 rescales nothing) and the fields are null, for report.json."""
    counts = {} if tally is None else {str(t): e for t, e in tally.counts.items()}
    missing = (None, None) if tally is None else (0, 0)
    for row in document["tasks"]:
        rescaled, survived = counts.get(row["model"], missing)
        row["rescaled"] = rescaled
        row["rescale_survived"] = survived
    document["written_dtypes"] = None if tally is None else sorted(tally.dtypes)
    return document


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float as None, so json.dumps(...,
    allow_nan=False) writes standard JSON (`null`) instead of Infinity / NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


# What the card's columns are shares of, one line each (Markdown list).
CARD_LEGEND = (
    "- *changed*: the parameters the agent changes (|θ_t − θ₀| > epsilon), "
    "as a share of all the parameters (elements) counted above.",
    "- *unique* / *shared*: shares of that agent's own changes that no other "
    "agent makes / that at least one other agent makes too.",
    "- *ρ = S/U*: its shared changes per unique one; *λ*: the factor RAM+ "
    "multiplies its unique changes by.",
    "- *λ survives*: the share of the agent's λ-scaled unique elements whose "
    "written value, rounded to the output dtype, still differs from plain RAM's "
    "(λ = 1); – when none was scaled.",
)


def card_section(
    settings: MergeSettings,
    stats: OverlapStatistics,
    scales: Mapping[Hashable, float],
    survival: SurvivalTally | None = None,
) -> str:
    """A short model-card section with the per-agent table.

    With a survival tally, a column says which share of each task's rescaled
    unique elements the rescale still changes in the written model.
    """
    lines = [
        "",
        "### RAM+ statistics",
        "",
        f"Whole-model overlap statistics (epsilon = {settings.epsilon:g}, "
        f"r = {settings.r:g}, alpha = {settings.alpha:g}, "
        f"{settings.saturation} rule) over {stats.num_tensors} tensors and "
        f"{stats.num_elements:,} elements, computed by mergekit-ram (a plugin "
        "for mergekit, installed from its repository; not on PyPI). "
        f"Full counts are in `{STATISTICS_FILE}`.",
        "",
    ]
    counts = {} if survival is None else survival.counts
    rows = []
    for task, row in zip(stats.tasks, task_rows(stats, scales)):
        rescaled, survived = counts.get(task, (0, 0))
        rows.append(
            [
                row["model"],
                percent(row["changed"], row["elements"]),
                percent(row["unique"], row["changed"]),
                percent(row["shared"], row["changed"]),
                "∞" if row["rho"] is None else f"{row['rho']:.4f}",
                f"{row['scale']:.4f}",
                percent(survived, rescaled, 1),
            ]
        )
    headers = ["model", "changed", "unique", "shared", "ρ = S/U", "λ", "λ survives"]
    lines += markdown_table(headers, rows)
    lines += ["", *CARD_LEGEND]
    if survival is not None and survival.lost():
        lines += ["", survival.warning()]
    return "\n".join(lines) + "\n"


class _InConfigOrder(MergeConfiguration):
    """A configuration whose referenced_models() follows the configuration."""

    def referenced_models(self) -> list[ModelReference]:
        found = model_references(self, groups(self))
        position = {reference: index for index, (_, reference) in enumerate(found)}
        return sorted(
            super().referenced_models(), key=lambda m: position.get(m, len(position))
        )


def in_config_order(config: MergeConfiguration) -> MergeConfiguration:
    """`config` as mergekit's card should see it: the card lists
    referenced_models(), a set in mergekit, so its model list (and its
    `base_model` metadata) changed order from run to run."""
    return _InConfigOrder.model_construct(**dict(config))
