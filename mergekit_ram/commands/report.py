"""The analysis report document (report.json), from one statistics pass.

The schema is docs/report_schema.md (schema_version SCHEMA_VERSION).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from mergekit_ram.commands.analysis import PAPER_R, Analysis
from mergekit_ram.core.counting import OverlapStatistics, TaskCounts, add_histogram
from mergekit_ram.core.naming import MODULES, layer_of, module_of
from mergekit_ram.core.scale import ScaleRule
from mergekit_ram.integration.results import statistics_document

SCHEMA_VERSION = 1


def labels_for(models: Sequence[str]) -> dict[str, str]:
    """Short names: last path component, or the full name where those collide."""
    short = {m: m.split("+")[0].rstrip("/").split("/")[-1] or m for m in models}
    if len(set(short.values())) < len(short):
        return {m: m for m in models}
    return short


def tensor_local_scales(
    stats: OverlapStatistics, task: Hashable, rule: ScaleRule
) -> dict[str, Any]:
    """The rule's λ inside each tensor where the task has unique elements."""
    values = []
    for per_task in stats.per_tensor.values():
        counts = per_task.get(task)
        if counts is not None and counts.unique > 0:
            values.append(
                (rule.scale(counts.shared, counts.unique), counts.elements, counts)
            )
    if not values:
        return dict(mean=None, unique_weighted_mean=None, min=None, max=None, tensors=0)
    elements = sum(e for _, e, _ in values)
    unique = sum(c.unique for _, _, c in values)
    return dict(
        mean=sum(v * e for v, e, _ in values) / elements,
        unique_weighted_mean=sum(v * c.unique for v, _, c in values) / unique,
        min=min(v for v, _, _ in values),
        max=max(v for v, _, _ in values),
        tensors=len(values),
    )


def _constant_summary(value: float, tensors: int) -> dict[str, Any]:
    return dict(
        mean=value, unique_weighted_mean=value, min=value, max=value, tensors=tensors
    )


def jaccard(intersection: int, changed_s: int, changed_t: int) -> float:
    union = changed_s + changed_t - intersection
    return intersection / union if union else 0.0


def pairwise(stats: OverlapStatistics, ids: Sequence[Hashable]) -> dict[str, Any]:
    """N×N intersections |m_s ∧ m_t| and Jaccard overlaps, in `ids` order."""
    changed = [stats.tasks[i].changed for i in ids]
    inter = [
        [
            changed[s] if s == t else stats.tasks[a].intersections.get(b, 0)
            for t, b in enumerate(ids)
        ]
        for s, a in enumerate(ids)
    ]
    return {
        "models": [str(i) for i in ids],
        "intersection": inter,
        "jaccard": [
            [jaccard(inter[s][t], changed[s], changed[t]) for t in range(len(ids))]
            for s in range(len(ids))
        ],
    }


def _grouped(
    stats: OverlapStatistics,
    ids: Sequence[Hashable],
    key: Callable[[str], Any],
    order: Sequence[Any] | None,
    field: str,
) -> list[dict[str, Any]]:
    groups: dict[Any, dict[str, Any]] = {}
    for name, per_task in stats.per_tensor.items():
        group = key(name)
        if group is None:
            continue
        entry = groups.setdefault(
            group,
            {"tensors": 0, "elements": 0, "counts": {i: TaskCounts() for i in ids}},
        )
        entry["tensors"] += 1
        entry["elements"] += next(iter(per_task.values())).elements if per_task else 0
        for task_id, counts in per_task.items():
            total = entry["counts"].setdefault(task_id, TaskCounts())
            add_histogram(total.histogram, counts.histogram)
    keys = [g for g in order if g in groups] if order else sorted(groups)
    return [
        {
            field: group,
            "tensors": groups[group]["tensors"],
            "elements": groups[group]["elements"],
            "tasks": [
                {
                    "model": str(task_id),
                    "changed": counts.changed,
                    "shared": counts.shared,
                    "unique": counts.unique,
                }
                for task_id, counts in groups[group]["counts"].items()
            ],
        }
        for group in keys
    ]


def build_report(
    analysis: Analysis, sweep: Sequence[float] | None = None
) -> dict[str, Any]:
    """The report document (report.json); docs/report_schema.md is the schema.

    `sweep` None means: no sweep, unless the settings have r = 0 (RAM), where
    the paper's r = 0.1 is tabulated so RAM+ can be compared.
    """
    settings, stats, scales = analysis.settings, analysis.stats, analysis.scales
    rule = settings.rule
    ids = list(stats.tasks)
    document = statistics_document(settings, stats, scales)
    rule_scales = stats.scales(rule)
    labels = labels_for([str(i) for i in ids])
    for row, task_id in zip(document["tasks"], ids):
        row["label"] = labels[str(task_id)]
        explicit = scales.get(task_id, 1.0) != rule_scales[task_id]
        row["scale_explicit"] = explicit
        local = tensor_local_scales(stats, task_id, rule)
        if explicit:
            local = _constant_summary(row["scale"], local["tensors"])
        row["scale_tensor_local"] = local
    if sweep is None:
        sweep = [PAPER_R] if settings.r == 0 else []
    sweeps = []
    for r in sweep:
        swept = ScaleRule(
            r=float(r), alpha=settings.alpha, saturation=settings.saturation
        )
        sweeps.append(
            {
                "r": float(r),
                "scale": {str(i): v for i, v in stats.scales(swept).items()},
                "scale_tensor_local": {
                    str(i): tensor_local_scales(stats, i, swept)["unique_weighted_mean"]
                    for i in ids
                },
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "method": analysis.method,
        "base_model": analysis.base_model,
        **document,
        "pairwise": pairwise(stats, ids),
        "per_module": _grouped(stats, ids, module_of, MODULES, "module"),
        "per_layer": _grouped(stats, ids, layer_of, None, "layer"),
        "sweep": sweeps,
    }
