"""The analysis report document (report.json), from one statistics pass.

`Analysis` is what the pass yields (from `mergekit-ram analyze` or from a
merge's own statistics); `build_report` derives the whole document from it.
The schema is docs/report_schema.md (schema_version SCHEMA_VERSION).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from mergekit_ram.analysis.naming import labels_for, layer_of
from mergekit_ram.analysis.pairs import changed_per_tensor, pairwise
from mergekit_ram.analysis.regime import METHODS, expected_unique, ratio, retentions
from mergekit_ram.analysis.verdict import verdict_of
from mergekit_ram.core.counting import OverlapStatistics, TaskCounts, add_histogram
from mergekit_ram.core.naming import MODULES, module_of
from mergekit_ram.core.rule import MergeSettings, ScaleRule, SurvivalTally
from mergekit_ram.integration.card import shared_mode
from mergekit_ram.integration.context import MergeRun
from mergekit_ram.integration.statistics import statistics_document, with_survival

# RAM+'s r in the paper: the sweep and retention use it where a configuration has r = 0.
PAPER_R = 0.1
# The paper's settings: what a configuration of another merge method is analysed with.
PAPER_DEFAULTS = MergeSettings(
    epsilon=1e-5, r=PAPER_R, alpha=2.0, saturation="clip", statistics="global"
)


@dataclass
class Analysis:
    """What one statistics pass yields, with the settings it was made for."""

    method: str
    base_model: str | None
    settings: MergeSettings
    stats: OverlapStatistics
    scales: dict[Hashable, float]
    # How much of λ survived the written dtype: only a merge counts it.
    survival: SurvivalTally | None = None
    # The configuration's `shared` mode, for the verdict's advice (None: unknown).
    shared: str | None = None

    @classmethod
    def from_merge(cls, config: Any, run: MergeRun) -> Analysis:
        """From the (settings, statistics, scales) a RAM+ merge computed."""
        settings, stats, scales = run.result
        base = config.base_model
        return cls(
            config.merge_method,
            None if base is None else str(base),
            settings,
            stats,
            dict(scales),
            run.tally,
            shared_mode(run.values),
        )


SCHEMA_VERSION = 1


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


def retention_rule(analysis: Analysis) -> ScaleRule:
    """The RAM+ rule retention is computed for: the configuration's, or the
    paper's r where the configuration has r = 0 (RAM+ would equal RAM)."""
    settings = analysis.settings
    if settings.r > 0:
        return settings.rule
    return ScaleRule(r=PAPER_R, alpha=settings.alpha, saturation=settings.saturation)


def retention(
    analysis: Analysis, explicit: dict[Hashable, float]
) -> dict[Hashable, dict[str, float | None]] | None:
    """Per task, retention under each analysis.regime method; None without
    inner products (statistics counted without them).

    RAM+ uses retention_rule's λ in the configuration's statistics scope,
    global or per tensor, with any explicit unique_scale instead.
    """
    stats = analysis.stats
    if not stats.inner_products:
        return None
    rule = retention_rule(analysis)
    ids = list(stats.tasks)
    if analysis.settings.statistics == "tensor":
        groups = [
            (
                products,
                {
                    **{
                        t: rule.scale(c.shared, c.unique)
                        for t, c in stats.per_tensor[name].items()
                    },
                    **explicit,
                },
            )
            for name, products in stats.products.items()
        ]
    else:
        scales = stats.scales(rule, explicit)
        groups = [(products, scales) for products in stats.products.values()]
    by_method = retentions(groups, ids)
    return {t: {m: values[t] for m, values in by_method.items()} for t in ids}


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


def retention_settings(analysis: Analysis, tasks: int) -> dict[str, Any] | None:
    """What the retention figures were computed with (report.json `retention`)."""
    if not analysis.stats.inner_products:
        return None
    rule = retention_rule(analysis)
    return {
        "methods": list(METHODS),
        "ramplus": {
            "r": rule.r,
            "alpha": rule.alpha,
            "saturation": rule.saturation,
            "statistics": analysis.settings.statistics,
        },
        "ta_mean_weight": 1.0 / tasks if tasks else None,
    }


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
    document = with_survival(
        statistics_document(settings, stats, scales), analysis.survival
    )
    rule_scales = stats.scales(rule)
    labels = labels_for([str(i) for i in ids])
    explicit = {
        i: scales[i] for i in ids if i in scales and scales[i] != rule_scales[i]
    }
    kept = retention(analysis, explicit)
    unique_expected = expected_unique(changed_per_tensor(stats, ids), len(ids))
    for row, task_id, alone in zip(document["tasks"], ids, unique_expected):
        row["label"] = labels[str(task_id)]
        row["scale_explicit"] = task_id in explicit
        local = tensor_local_scales(stats, task_id, rule)
        if task_id in explicit:
            local = _constant_summary(row["scale"], local["tensors"])
        row["scale_tensor_local"] = local
        row["unique_share"] = ratio(row["unique"], row["changed"])
        row["expected_unique_share"] = ratio(alone, row["changed"])
        row["retention"] = None if kept is None else kept[task_id]
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
        "retention": retention_settings(analysis, len(ids)),
        "verdict": verdict_of(stats, analysis.shared).as_dict(),
    }
