"""The analysis report document (report.json), from one statistics pass.

`Analysis` is what the pass yields (from `mergekit-ram analyze` or from a
merge's own statistics); `build_report` derives the whole document from it.
The document is the schema docs/report_schema.md states, and what the
renderings and figures read, so that what is shown is what is written.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from mergekit_ram.analysis.regime import (
    METHODS,
    changed_per_tensor,
    expected,
    pairwise,
    ratio,
    retentions,
)
from mergekit_ram.analysis.verdict import judge
from mergekit_ram.core.counting import OverlapStatistics, TaskCounts, add_histogram
from mergekit_ram.core.naming import MODULES, module_of
from mergekit_ram.core.rule import MergeSettings, ScaleRule, SurvivalTally
from mergekit_ram.integration.card import shared_mode
from mergekit_ram.integration.context import MergeRun
from mergekit_ram.integration.statistics import statistics_document, with_survival

SCHEMA_VERSION = 1
# RAM+'s r in the paper: the sweep and retention use it where a configuration has r = 0.
PAPER_R = 0.1
# The paper's settings: what a configuration of another merge method is analysed with.
PAPER_DEFAULTS = MergeSettings(
    epsilon=1e-5, r=PAPER_R, alpha=2.0, saturation="clip", statistics="global"
)


@dataclass
class Analysis:
    """What one statistics pass yields, with the settings it was made for;
    `survival`: how much of λ survived the written dtype (only a merge counts
    it); `shared`: the configuration's `shared` mode, for the verdict's advice."""

    method: str
    base_model: str | None
    settings: MergeSettings
    stats: OverlapStatistics
    scales: dict[Hashable, float]
    survival: SurvivalTally | None = None
    shared: str | None = None

    @classmethod
    def from_merge(cls, config: Any, run: MergeRun) -> Analysis:
        """From the (settings, statistics, scales) a RAM merge counted."""
        settings, stats, scales = run.counted
        base = None if config.base_model is None else str(config.base_model)
        shared = shared_mode(run.values)
        return cls(
            config.merge_method, base, settings, stats, dict(scales), run.tally, shared
        )


def layer_of(name: str) -> int | None:
    """The layer index in a tensor name (first all-digit component), or None."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else None


def labels_for(models: Sequence[str]) -> dict[str, str]:
    """Short names: last path component, or the full name where those collide."""
    short = {m: m.split("+")[0].rstrip("/").split("/")[-1] or m for m in models}
    return short if len(set(short.values())) == len(short) else {m: m for m in models}


def tensor_local_scales(
    stats: OverlapStatistics, task: Hashable, rule: ScaleRule
) -> dict[str, Any]:
    """The rule's λ inside each tensor where the task has unique elements."""
    values = [
        (rule.scale(c.shared, c.unique), c)
        for c in (per_task.get(task) for per_task in stats.per_tensor.values())
        if c is not None and c.unique > 0
    ]
    if not values:
        return dict(mean=None, unique_weighted_mean=None, min=None, max=None, tensors=0)
    lams = [v for v, _ in values]
    mean = sum(v * c.elements for v, c in values) / sum(c.elements for _, c in values)
    weighted = sum(v * c.unique for v, c in values) / sum(c.unique for _, c in values)
    found = dict(mean=mean, unique_weighted_mean=weighted, min=min(lams))
    return found | dict(max=max(lams), tensors=len(values))


def retention(
    stats: OverlapStatistics, settings: MergeSettings, explicit: dict[Hashable, float]
) -> dict | None:
    """Per task, its retention under each method of METHODS, RAM+ with the
    λ of `settings` in its statistics scope, an explicit unique_scale instead
    where set; None without inner products."""
    if not stats.inner_products:
        return None
    rule, local = settings.rule, settings.statistics == "tensor"
    whole = stats.scales(rule, explicit)  # the same λ for every tensor
    groups = [
        (sums, stats.scales(rule, explicit, stats.per_tensor[n]) if local else whole)
        for n, sums in stats.products.items()
    ]
    by_method = retentions(groups, list(stats.tasks))
    return {t: {m: values[t] for m, values in by_method.items()} for t in stats.tasks}


def _grouped(
    stats: OverlapStatistics,
    ids: Sequence[Hashable],
    key: Callable[[str], Any],
    field: str,
    order: Callable[[Any], Any] | None = None,
) -> list[dict[str, Any]]:
    """Per group of tensors (`key` of a name; None: in no group), sorted
    by `order`: its size and each task's counts summed over it."""
    groups: dict[Any, dict[str, Any]] = {}
    for name, per_task in stats.per_tensor.items():
        if (group := key(name)) is None:
            continue
        new = {field: group, "tensors": 0, "elements": 0}
        new["tasks"] = {i: TaskCounts() for i in ids}
        entry = groups.setdefault(group, new)
        entry["tensors"] += 1
        entry["elements"] += next(iter(per_task.values())).elements if per_task else 0
        for task_id, counts in per_task.items():
            add_histogram(entry["tasks"][task_id].histogram, counts.histogram)
    for entry in groups.values():
        entry["tasks"] = [
            dict(model=str(i), changed=c.changed, shared=c.shared, unique=c.unique)
            for i, c in entry["tasks"].items()
        ]
    return [groups[group] for group in sorted(groups, key=order)]


def build_report(
    analysis: Analysis, sweep: Sequence[float] | None = None
) -> dict[str, Any]:
    """The report document (report.json); docs/report_schema.md is the schema.

    `sweep` None means: no sweep, unless the settings have r = 0 (RAM), where
    the paper's r = 0.1 is tabulated so RAM+ can be compared.
    """
    settings, stats, scales = analysis.settings, analysis.stats, analysis.scales
    rule, ids = settings.rule, list(stats.tasks)
    document = statistics_document(settings, stats, scales)
    document = with_survival(document, analysis.survival)
    computed = stats.scales(rule)
    labels = labels_for([str(i) for i in ids])
    # Read by lookup only: its order plays no part.
    explicit = {i: v for i, v in scales.items() if i in computed and v != computed[i]}
    plus = dataclasses.replace(settings, r=settings.r or PAPER_R)
    kept = retention(stats, plus, explicit)
    independent, alone = expected(changed_per_tensor(stats, ids), len(ids))
    for row, task_id, unique in zip(document["tasks"], ids, alone):
        local = tensor_local_scales(stats, task_id, rule)
        if task_id in explicit:
            local = {**dict.fromkeys(local, row["scale"]), "tensors": local["tensors"]}
        row |= {
            "label": labels[str(task_id)],
            "scale_explicit": task_id in explicit,
            "scale_tensor_local": local,
            "unique_share": ratio(row["unique"], row["changed"]),
            "expected_unique_share": ratio(unique, row["changed"]),
            "retention": None if kept is None else kept[task_id],
        }
    if sweep is None:
        sweep = [PAPER_R] if settings.r == 0 else []
    sweeps = []
    for r in map(float, sweep):
        swept = dataclasses.replace(settings, r=r).rule
        scale = {str(i): v for i, v in stats.scales(swept).items()}
        local = [tensor_local_scales(stats, i, swept) for i in ids]
        local = {str(i): x["unique_weighted_mean"] for i, x in zip(ids, local)}
        sweeps.append({"r": r, "scale": scale, "scale_tensor_local": local})
    plus = {k: v for k, v in plus.as_dict().items() if k != "epsilon"}
    weight = 1.0 / len(ids) if ids else None
    about = {"methods": list(METHODS), "ramplus": plus, "ta_mean_weight": weight}
    report = {
        "schema_version": SCHEMA_VERSION,
        "method": analysis.method,
        "base_model": analysis.base_model,
        **document,
        "pairwise": pairwise(stats, ids, independent),
        "per_module": _grouped(stats, ids, module_of, "module", MODULES.index),
        "per_layer": _grouped(stats, ids, layer_of, "layer"),
        "sweep": sweeps,
        "retention": None if kept is None else about,
    }
    return report | {"verdict": judge(report, analysis.shared)}
