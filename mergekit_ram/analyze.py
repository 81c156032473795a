"""`mergekit-ram analyze`: look at the agents' task vectors before merging them.

The analysis plans the configuration exactly as a merge would (mergekit's
MergePlanner, without our RAM+ hook so nothing is counted twice) and runs the
one statistics engine, `statistics.collect_planned`, over the planned groups:
every tensor group is read once, counted, and dropped. Everything below is
derived from the resulting `OverlapStatistics` (whole-model totals, per-tensor
counts and pairwise mask intersections), so `mergekit-ram merge --report` can
build the very same report from the statistics its merge already computed.

Settings. For `ram` / `ramplus` configurations epsilon, r, alpha, saturation
and statistics are resolved as the merge resolves them (`ram` means r = 0:
every λ is 1, and the report then adds an r sweep at the paper's r = 0.1).
For any other merge method only the models and the base matter and the paper
defaults are used (epsilon 1e-5, r 0.1, alpha 2, clip, global). `--epsilon`
overrides epsilon in both cases.

report.json, schema_version 1 (docs/report_schema.md has the same text)
------------------------------------------------------------------------
The top level is ram_statistics.json's document plus additions::

    schema_version  int    1; bumped on any incompatible change
    method          str    the configuration's merge_method
    base_model      str    the base model (mergekit's model reference)
    epsilon, r, alpha, saturation, statistics
                           the settings the numbers were computed with
    num_tensors, num_elements, seconds
                           what the statistics pass covered, and its time
    tasks           list   one object per task model, in configuration order:
        model, elements, changed, shared, unique, overlap_histogram, rho, scale
                           as in ram_statistics.json (rho null = infinite;
                           scale = the global λ the merge would apply,
                           including an explicit unique_scale)
        label              short display name (last path component)
        scale_explicit     bool, scale came from an explicit unique_scale
        scale_tensor_local {mean, unique_weighted_mean, min, max, tensors}:
                           the rule's λ computed inside each tensor
                           (statistics: tensor) over the `tensors` in which
                           the task has unique elements; mean is weighted by
                           tensor size, unique_weighted_mean by the task's
                           unique elements there; all null when there is
                           none; an explicit unique_scale gives that value
    pairwise        object {models, intersection, jaccard}: N×N matrices in
                           `tasks` order; intersection[s][t] = |m_s ∧ m_t|
                           (diagonal: changed), jaccard = I / (C_s + C_t − I),
                           0 where both masks are empty
    per_module      list   {module, tensors, elements, tasks: [{model,
                           changed, shared, unique}]}, module one of
                           embeddings, attention, mlp, norms, lm_head, other
    per_layer       list   the same per layer index ({layer, ...}), for the
                           tensors whose name has a layer index
    sweep           list   {r, scale: {model: λ}, scale_tensor_local: {model:
                           unique-weighted tensor-local λ or null}} per swept
                           r, with the configuration's alpha and saturation
                           and no explicit unique_scale
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import textwrap
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergekit_ram.report import percent, statistics_document, strict_json
from mergekit_ram.scale import ScaleRule
from mergekit_ram.settings import MergeSettings
from mergekit_ram.statistics import OverlapStatistics, TaskCounts

SCHEMA_VERSION = 1
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PAPER_R = 0.1
MODULES = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")
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

    @classmethod
    def from_merge(cls, config: Any, result: tuple) -> Analysis:
        """From the (settings, statistics, scales) a RAM+ merge computed."""
        settings, stats, scales = result
        base = config.base_model
        return cls(
            config.merge_method,
            None if base is None else str(base),
            settings,
            stats,
            dict(scales),
        )


# ---------------------------------------------------------------- planning


def plan_merges(config: Any, options: Any) -> list[Any]:
    """The merge tasks a merge of `config` would run (config is not modified).

    As mergekit.merge.run_merge plans, but through the planner's original
    `_plan`, so the RAM+ hook does not run its own statistics pass. A
    configuration of another merge method is planned as `ramplus` with no
    global parameters: the same tensors, inputs and gather tasks.
    """
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge import _model_out_config
    from mergekit.plan import MergePlanner
    from tqdm import tqdm

    from mergekit_ram.install import install
    from mergekit_ram.method import is_ours

    install()
    config = config.model_copy(deep=True)
    if not is_ours(config.merge_method):
        # Only the models and the base matter: plan as RAM+ so that another
        # method's required parameters (weight, density, ...) are not needed
        # and its own parameters (DELLA's epsilon, ...) are not read as ours.
        config.merge_method = "ramplus"
        config.parameters = None
    if not config.models and not config.slices and not config.modules:
        raise ValueError("the configuration has no models")
    arch_info = get_architecture_info(config, options)
    loader_cache = LoaderCache()
    loader_cache.setup(options=options)
    out_config = _model_out_config(
        config, arch_info, trust_remote_code=options.trust_remote_code
    )
    for model in tqdm(
        config.referenced_models(), desc="Warmup loader cache", disable=options.quiet
    ):
        loader_cache.get(model)
    planner = MergePlanner(
        config, arch_info, options=options, out_model_config=out_config
    )
    plan = getattr(MergePlanner._plan, "__mergekit_ram__", MergePlanner._plan)
    plan(planner)
    return [task for _, task in planner._tensors]


def resolve_settings(
    method: str, merges: Sequence[Any], epsilon: float | None
) -> tuple[MergeSettings, dict[Hashable, float | None]]:
    """Settings and explicit unique_scale per model, as the merge would use them."""
    from mergekit_ram.method import is_ours
    from mergekit_ram.planning import planned_settings

    if is_ours(method):
        settings, explicit = planned_settings(list(merges))
    else:
        settings, explicit = PAPER_DEFAULTS, {}
    if epsilon is not None:
        settings = dataclasses.replace(settings, epsilon=float(epsilon))
    return settings, explicit


def analyze_config(
    config: Any, options: Any, *, epsilon: float | None = None
) -> Analysis:
    """Plan `config` and run the statistics engine once over its tensors."""
    from mergekit_ram.planning import count_planned

    merges = plan_merges(config, options)
    if not merges:
        raise ValueError("the configuration plans no tensors")
    base = merges[0].base_model
    if base is None:
        raise ValueError(
            "analyze needs a base_model: task vectors are measured from it"
        )
    settings, explicit = resolve_settings(config.merge_method, merges, epsilon)
    stats, scales = count_planned(
        merges, settings, explicit, options, desc="Analyzing task vectors"
    )
    reference = config.base_model if config.base_model is not None else base
    return Analysis(config.merge_method, str(reference), settings, stats, scales)


def merge_with_analysis(
    config: Any,
    out_path: str,
    options: Any,
    config_source: str,
    echo: Callable[[str], None] = print,
) -> Analysis:
    """Merge, and return the analysis of its inputs without a second pass.

    A merge that ran the statistics pass hands its counts over; one that
    needed none (RAM, tensor scope, explicit λ, another method) is analysed
    with one more read of the models, and `echo` says which happened.
    """
    from mergekit_ram.api import run_merge
    from mergekit_ram.planning import capture_result

    with capture_result(out_path) as captured:
        run_merge(config, out_path, options=options, config_source=config_source)
    result = captured[-1] if captured else None
    if result is not None:
        echo("Report from the statistics this merge computed (no extra pass).")
        return Analysis.from_merge(config, result)
    echo(
        "This merge needed no whole-model statistics pass (RAM with r = 0, "
        "statistics: tensor, explicit unique_scale or another method); "
        "reading the models once more for the report."
    )
    return analyze_config(config, options)


# ---------------------------------------------------------------- the report


def module_of(name: str) -> str:
    """embeddings, attention, mlp, norms, lm_head or other, from a tensor name."""
    lower = name.lower()
    if "lm_head" in lower or "embed_out" in lower:
        return "lm_head"
    if "embed" in lower or re.search(r"(^|\.)(wte|wpe)(\.|$)", lower):
        return "embeddings"
    if "norm" in lower or re.search(r"(^|\.)ln_?\w*(\.|$)", lower):
        return "norms"
    if re.search(r"attn|attention|(^|\.)(q|k|v|o|qkv)_proj(\.|$)", lower):
        return "attention"
    if re.search(r"mlp|feed_forward|ffn|(up|down|gate)_proj|(^|\.)fc\d", lower):
        return "mlp"
    return "other"


def layer_of(name: str) -> int | None:
    """The layer index in a tensor name (first all-digit component), or None."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else None


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
            hist = total.histogram
            hist.extend([0] * (len(counts.histogram) - len(hist)))
            for k, value in enumerate(counts.histogram):
                hist[k] += value
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
    """The report document (report.json); see the module docstring for the schema.

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


# ---------------------------------------------------------------- rendering


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}"


def _rho(value: float | None) -> str:
    return "inf" if value is None else f"{value:.4f}"


def sections(report: Mapping[str, Any]) -> list[tuple[str, list[str], list, list]]:
    """(title, notes, headers, rows) for each table of the report."""
    tasks = report["tasks"]
    label = {t["model"]: t["label"] for t in tasks}
    names = [t["label"] for t in tasks]
    n = len(tasks)
    out = []

    rows = []
    for t in tasks:
        local = t["scale_tensor_local"]
        spread = (
            "–"
            if local["min"] is None
            else f"{local['unique_weighted_mean']:.4f} "
            f"[{local['min']:.4f}, {local['max']:.4f}]"
        )
        rows.append(
            [
                t["label"],
                percent(t["changed"], t["elements"]),
                f"{t['changed']:,}",
                f"{t['unique']:,}",
                f"{t['shared']:,}",
                percent(t["unique"], t["changed"], 1),
                _rho(t["rho"]),
                _num(t["scale"]) + (" (explicit)" if t["scale_explicit"] else ""),
                spread,
            ]
        )
    scope = report["statistics"]
    out.append(
        (
            "Per task",
            [
                "changed % = share of all parameters; unique % = share of the "
                "task's changes no other task makes; rho = shared / unique.",
                "λ global = whole-model statistics (the paper; statistics: "
                "global); λ tensor-local = per-tensor statistics (statistics: "
                "tensor), mean over the task's unique elements [min, max over "
                f"tensors]. This configuration uses the {scope} one.",
            ],
            [
                "task",
                "changed %",
                "changed",
                "unique",
                "shared",
                "unique %",
                "rho",
                "λ global",
                "λ tensor-local",
            ],
            rows,
        )
    )

    headers = ["task"] + ["k=0 (unique)" if k == 0 else f"k={k}" for k in range(n)]
    rows = []
    for t in tasks:
        hist = list(t["overlap_histogram"]) + [0] * (n - len(t["overlap_histogram"]))
        rows.append(
            [t["label"]] + [f"{v:,} ({percent(v, t['changed'], 1)})" for v in hist[:n]]
        )
    out.append(
        (
            "k-way overlap",
            [
                "Each task's changed elements by how many other tasks change "
                "them too (share of the task's changes)."
            ],
            headers,
            rows,
        )
    )

    pair = report["pairwise"]
    rows = [
        [label[a]] + [f"{v:.4f}" for v in pair["jaccard"][s]]
        for s, a in enumerate(pair["models"])
    ]
    out.append(
        (
            "Pairwise overlap (Jaccard)",
            ["|m_s ∧ m_t| / |m_s ∨ m_t| of the change masks."],
            [""] + names,
            rows,
        )
    )

    def cells(entry):
        by_model = {x["model"]: x for x in entry["tasks"]}
        values = []
        for t in tasks:
            x = by_model.get(t["model"])
            if x is None:
                values.append("–")
            else:
                values.append(
                    f"{percent(x['changed'], entry['elements'])} "
                    f"({percent(x['unique'], x['changed'], 0)} unique)"
                )
        return values

    rows = [
        [e["module"], str(e["tensors"]), f"{e['elements']:,}"] + cells(e)
        for e in report["per_module"]
    ]
    out.append(
        (
            "Per module",
            [
                "Share of the module's parameters each task changes (and the "
                "unique share of those changes)."
            ],
            ["module", "tensors", "elements"] + names,
            rows,
        )
    )

    rows = []
    for e in report["per_layer"]:
        by_model = {x["model"]: x for x in e["tasks"]}
        rows.append(
            [str(e["layer"]), f"{e['elements']:,}"]
            + [
                percent(by_model[t["model"]]["changed"], e["elements"])
                if t["model"] in by_model
                else "–"
                for t in tasks
            ]
        )
    if rows:
        out.append(
            (
                "Per layer",
                ["Share of each layer's parameters the task changes."],
                ["layer", "elements"] + names,
                rows,
            )
        )

    if report["sweep"]:
        rows = [
            [f"{s['r']:g}"]
            + [
                f"{s['scale'][t['model']]:.4f} / "
                f"{_num(s['scale_tensor_local'][t['model']])}"
                for t in tasks
            ]
            for s in report["sweep"]
        ]
        notes = [
            f"λ per task for each r (alpha = {report['alpha']:g}, "
            f"{report['saturation']} rule): global / tensor-local "
            "(mean over unique elements)."
        ]
        if report["r"] == 0:
            notes.append(
                "r = 0 in this configuration (RAM: every λ is 1); the sweep "
                f"shows RAM+ at the paper's r = {PAPER_R:g}. Try --r 0,0.05,0.1,0.2."
            )
        out.append(("λ sweep over r", notes, ["r"] + names, rows))
    return out


def _header(report: Mapping[str, Any]) -> list[str]:
    from mergekit_ram.method import is_ours

    lines = [
        f"Task vectors of {len(report['tasks'])} task model(s) against "
        f"{report['base_model']} ({report['method']} configuration)",
        f"{report['num_tensors']} tensors, {report['num_elements']:,} elements; "
        f"epsilon = {report['epsilon']:g}; λ rule: r = {report['r']:g}, "
        f"alpha = {report['alpha']:g}, {report['saturation']}, "
        f"{report['statistics']} statistics",
    ]
    if not is_ours(report["method"]):
        lines.append(
            "Not a ram/ramplus configuration: λ uses the paper's RAM+ defaults."
        )
    return lines


def _text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]

    def line(cells):
        first, *rest = [str(c) for c in cells]
        return "  ".join(
            [first.ljust(widths[0])] + [c.rjust(w) for c, w in zip(rest, widths[1:])]
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [line(headers), rule] + [line(r) for r in rows]


def render_text(report: Mapping[str, Any]) -> str:
    """The terminal report."""
    lines = _header(report)
    for title, notes, headers, rows in sections(report):
        lines += ["", title + ":"]
        lines += _text_table(headers, rows)
        lines += [wrapped for note in notes for wrapped in textwrap.wrap(note, 100)]
    labels = {t["model"]: t["label"] for t in report["tasks"]}
    if any(k != v for k, v in labels.items()):
        lines += ["", "Models:"] + [f"  {v} = {k}" for k, v in labels.items()]
    return "\n".join(lines) + "\n"


def _md_cell(value: Any) -> str:
    return str(value).replace("|", "\\|")


def render_markdown(
    report: Mapping[str, Any], figures: Sequence[str] = (), note: str | None = None
) -> str:
    """report.md: the same tables, with the figures."""
    lines = ["# mergekit-ram analysis", ""]
    lines += [line + "  " for line in _header(report)]
    for title, notes, headers, rows in sections(report):
        lines += ["", f"## {title}", ""]
        lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
        lines.append("|" + "---|" * len(headers))
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
        for line in notes:
            lines += ["", line]
    lines += ["", "## Models", ""]
    lines += [f"- {t['label']}: `{t['model']}`" for t in report["tasks"]]
    if figures or note:
        lines += ["", "## Figures", ""]
        lines += [f"![{os.path.splitext(f)[0]}]({f})" for f in figures]
        if note:
            lines.append(note)
    lines += ["", f"Data: `{REPORT_JSON}` (schema_version {report['schema_version']})."]
    return "\n".join(lines) + "\n"


def write_report(report: Mapping[str, Any], out_dir: str) -> tuple[list[str], str]:
    """Write report.json, the figures and report.md; returns (paths, message)."""
    from mergekit_ram import figures

    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, REPORT_JSON)]
    with open(paths[0], "w", encoding="utf-8") as handle:
        json.dump(strict_json(report), handle, indent=2, allow_nan=False)
        handle.write("\n")
    note = None
    if figures.available():
        names = figures.write_figures(report, out_dir)
    else:
        names = []
        note = (
            "Figures skipped: matplotlib is not installed. Install the plots "
            f"extra to get them: {figures.INSTALL_HINT}"
        )
    md = os.path.join(out_dir, REPORT_MD)
    with open(md, "w", encoding="utf-8") as handle:
        handle.write(render_markdown(report, names, note))
    paths += [md] + [os.path.join(out_dir, name) for name in names]
    message = f"Report written to {out_dir}: " + ", ".join(
        os.path.basename(p) for p in paths
    )
    if note:
        message += "\n" + note
    return paths, message


def parse_r_values(text: str) -> list[float]:
    """'0,0.05,0.1' → [0.0, 0.05, 0.1]; every value finite and ≥ 0."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        value = float(part)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"r must be a finite number ≥ 0, got {part!r}")
        values.append(value)
    if not values:
        raise ValueError("no r value given")
    return values
