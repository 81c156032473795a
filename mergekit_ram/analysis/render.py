"""The analysis report as text (terminal) and Markdown (report.md)."""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergekit_ram.analysis.regime import METHODS
from mergekit_ram.analysis.report import PAPER_R
from mergekit_ram.analysis.tables import Section, percent
from mergekit_ram.analysis.verdict import NESTED, OVERLAPPING, unique_share_departure
from mergekit_ram.core.rule import ScaleRule
from mergekit_ram.integration.methods import is_ours

REPORT_JSON = "report.json"


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}"


def _rho(value: float | None) -> str:
    return "inf" if value is None else f"{value:.4f}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100.0 * value:.1f} %"


def _rule(report: Mapping[str, Any]) -> ScaleRule:
    return ScaleRule(report["r"], report["alpha"], report["saturation"])


# What a pair's supports mean for RAM, said only for the kinds present.
LIFT_NOTES = {
    "independent": "lift ≈ 1: independent supports, as the paper's agents "
    "(trained apart) have: they overlap only by chance, and where one agent "
    "alone changes an element RAM keeps its full change while averaging "
    "divides it by N.",
    "overlapping": f"lift ≥ {OVERLAPPING:g}: overlapping supports (e.g. one "
    "recipe for every agent): the agents change the same elements, which RAM "
    "averages as task arithmetic does, so it has less to keep.",
    "disjoint": f"lift ≤ {1 / OVERLAPPING:.2f}: the agents avoid each other's "
    "elements, so RAM keeps nearly every change whole.",
    "nested": f"nested: at least {100 * NESTED:g} % of one agent's changes lie "
    "inside another's, so RAM averages nearly all of them.",
}


def lift_notes(report: Mapping[str, Any]) -> list[str]:
    """The explanations of the pair kinds the verdict found, in its order."""
    found = {pair["supports"] for pair in report["verdict"]["pairs"]}
    return [note for kind, note in LIFT_NOTES.items() if kind in found]


def unique_share_notes(tasks: Sequence[Mapping[str, Any]]) -> list[str]:
    """A note for the tasks whose unique share is far from its expectation."""
    by_departure: dict[str, list[str]] = {}
    for t in tasks:
        departure = unique_share_departure(
            t["unique_share"], t["expected_unique_share"]
        )
        if departure is not None:
            by_departure.setdefault(departure, []).append(t["label"])
    notes = []
    if "below" in by_departure:
        notes.append(
            f"Far below expected for {', '.join(by_departure['below'])}: their "
            "changes pile up on elements other tasks change too."
        )
    if "above" in by_departure:
        notes.append(
            f"Far above expected for {', '.join(by_departure['above'])}: their "
            "changes avoid the elements other tasks change."
        )
    return notes


def regime_sections(
    report: Mapping[str, Any],
) -> list[Section]:
    """The two tables that say which regime the task models are in."""
    tasks = report["tasks"]
    label = {t["model"]: t["label"] for t in tasks}
    pair = report["pairwise"]
    out = []
    rows = []
    for s, a in enumerate(pair["models"]):
        for t in range(s + 1, len(pair["models"])):
            b = pair["models"][t]
            rows.append(
                [
                    f"{label[a]} × {label[b]}",
                    f"{pair['intersection'][s][t]:,}",
                    f"{pair['expected_intersection'][s][t]:,.0f}",
                    _num(pair["lift"][s][t], 2),
                    f"{pair['jaccard'][s][t]:.4f}",
                    f"{pair['expected_jaccard'][s][t]:.4f}",
                ]
            )
    if rows:
        out.append(
            Section(
                "Overlap against independent supports",
                [
                    "expected = Σ over tensors of n·d_s·d_t: the overlap of "
                    "independent random supports with the same per-tensor "
                    "densities d; lift = overlap / expected."
                ]
                + lift_notes(report),
                ["pair", "overlap", "expected", "lift", "Jaccard", "expected J."],
                rows,
            )
        )
    settings = report.get("retention")
    methods = list(settings["methods"]) if settings else []
    rows = []
    for t in tasks:
        kept = t["retention"] or {}
        rows.append(
            [
                t["label"],
                _share(t["unique_share"]),
                _share(t["expected_unique_share"]),
            ]
            + [
                _num(kept.get(m), 3) if kept.get(m) is not None else "n/a"
                for m in methods
            ]
        )
    notes = [
        "unique % = the task's changes no other task makes; expected = the "
        "same for independent supports with the same per-tensor densities."
    ] + unique_share_notes(tasks)
    if settings:
        plus = settings["ramplus"]
        rule = ScaleRule(plus["r"], plus["alpha"], plus["saturation"])
        notes.append(
            "retention = ⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩: how much of the task's "
            "own task vector the merged one keeps (1: all of it, as on its "
            "own; averaging keeps about 1/N of a change no other task makes; "
            "n/a: the task changes nothing). From this pass, no merge or "
            f"evaluation. RAM+: r = {plus['r']:g}, {rule.saturation_text()}, "
            f"{plus['statistics']} statistics; TA 1/N, TA 1: task arithmetic "
            "with weight 1/N, 1 per task."
        )
    out.append(
        Section(
            "Unique share and retention",
            notes,
            ["task", "unique %", "expected"] + [METHODS[m] for m in methods],
            rows,
        )
    )
    return out


def sections(report: Mapping[str, Any]) -> list[Section]:
    """Each table of the report, with its notes."""
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
        Section(
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
        Section(
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
        Section(
            "Pairwise overlap (Jaccard)",
            ["|m_s ∧ m_t| / |m_s ∨ m_t| of the change masks."],
            [""] + names,
            rows,
        )
    )
    out += regime_sections(report)

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
        Section(
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
            Section(
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
            f"λ per task for each r ({_rule(report).saturation_text()}): "
            "global / tensor-local (mean over unique elements)."
        ]
        if report["r"] == 0:
            notes.append(
                "r = 0 in this configuration (RAM: every λ is 1); the sweep "
                f"shows RAM+ at the paper's r = {PAPER_R:g}. Try --r 0,0.05,0.1,0.2."
            )
        out.append(Section("λ sweep over r", notes, ["r"] + names, rows))
    return out


def _header(report: Mapping[str, Any]) -> list[str]:
    lines = [
        f"Task vectors of {len(report['tasks'])} task model(s) against "
        f"{report['base_model']} ({report['method']} configuration)",
        f"{report['num_tensors']} tensors, {report['num_elements']:,} elements; "
        f"epsilon = {report['epsilon']:g}; λ: r = {report['r']:g}, "
        f"{_rule(report).saturation_text()}, {report['statistics']} statistics",
    ]
    if not is_ours(report["method"]):
        lines.append(
            "Not a ram/ramplus configuration: λ uses the paper's RAM+ defaults."
        )
    return lines


@dataclass(frozen=True)
class Document:
    """The report once, for both renderings: its title, what was measured
    (`header`), the verdict, the tables, and each model's label."""

    title: str
    header: list[str]
    verdict: str
    sections: list[Section]
    labels: dict[str, str]


def document(report: Mapping[str, Any]) -> Document:
    """report.json's report model."""
    return Document(
        "mergekit-ram analysis",
        _header(report),
        report["verdict"]["sentence"],
        sections(report),
        {t["model"]: t["label"] for t in report["tasks"]},
    )


def render_text(report: Mapping[str, Any]) -> str:
    """The terminal report (models listed only where a label shortens one)."""
    doc = document(report)
    lines = doc.header + [""] + textwrap.wrap("Verdict: " + doc.verdict, 100)
    for section in doc.sections:
        lines += section.text()
    if any(model != label for model, label in doc.labels.items()):
        lines += ["", "Models:"] + [f"  {v} = {k}" for k, v in doc.labels.items()]
    return "\n".join(lines) + "\n"


def render_markdown(
    report: Mapping[str, Any], figures: Sequence[str] = (), note: str | None = None
) -> str:
    """report.md: the same report model, with the figures."""
    doc = document(report)
    lines = [f"# {doc.title}", ""] + [line + "  " for line in doc.header]
    lines += ["", f"**Verdict:** {doc.verdict}"]
    for section in doc.sections:
        lines += section.markdown()
    lines += ["", "## Models", ""]
    lines += [f"- {label}: `{model}`" for model, label in doc.labels.items()]
    if figures or note:
        lines += ["", "## Figures", ""]
        lines += [f"![{os.path.splitext(f)[0]}]({f})" for f in figures]
        if note:
            lines.append(note)
    lines += ["", f"Data: `{REPORT_JSON}` (schema_version {report['schema_version']})."]
    return "\n".join(lines) + "\n"
