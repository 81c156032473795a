"""The analysis report as Markdown: one rendering for the terminal and
report.md (its tables padded so that they read as columns in a terminal),
and the tables the model card shares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ram.analysis.regime import METHODS
from mergekit_ram.analysis.report import PAPER_R
from mergekit_ram.analysis.verdict import NESTED, OVERLAPPING, unique_share_departure
from mergekit_ram.core.rule import ScaleRule
from mergekit_ram.integration.methods import is_ours

Report = Mapping[str, Any]


def percent(part: float, whole: float, digits: int = 2) -> str:
    """`part` as a percentage of `whole`, or a dash when `whole` is 0."""
    return f"{100.0 * part / whole:.{digits}f} %" if whole else "–"


def markdown_table(
    headers: Sequence[Any], rows: Sequence[Sequence[Any]], aligned: bool = True
) -> list[str]:
    """A GitHub-flavoured Markdown table, `|` in cells escaped; `aligned`:
    cells padded to their column's width, the first column left-aligned and
    the others right-aligned."""
    table = [[str(c).replace("|", "\\|") for c in row] for row in (headers, *rows)]
    widths = [max(3, *map(len, column)) if aligned else 0 for column in zip(*table)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = [c.rjust(w) for c, w in zip(cells, widths)]
        return "| " + " | ".join([cells[0].ljust(widths[0]), *rest]) + " |"

    rule = ["-" * (w + 1) + ":" if aligned else "---" for w in widths]
    rule[0] = rule[0].replace(":", "-")
    return [line(table[0]), "|" + "|".join(rule) + "|", *map(line, table[1:])]


def section(
    title: str,
    headers: Sequence[Any],
    rows: Sequence[Sequence[Any]],
    notes: Sequence[str],
    intro: Sequence[str] = (),
    level: int = 2,
    aligned: bool = True,
) -> list[str]:
    """A heading of `level`, then `intro`, the table and `notes`, blank-line apart."""
    lines = ["", "#" * level + " " + title, ""]
    for paragraph in intro:
        lines += [paragraph, ""]
    lines += markdown_table(headers, rows, aligned)
    for paragraph in notes:
        lines += ["", paragraph]
    return lines


def _num(value: float | None, digits: int = 4, none: str = "–") -> str:
    return none if value is None else f"{value:.{digits}f}"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{100.0 * value:.1f} %"


def _rule_text(s: Report) -> str:
    return ScaleRule(*(s[k] for k in ("r", "alpha", "saturation"))).saturation_text()


def _labels(report: Report) -> list[str]:
    return [t["label"] for t in report["tasks"]]


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
UNIQUE_NOTES = {
    "below": "their changes pile up on elements other tasks change too",
    "above": "their changes avoid the elements other tasks change",
}


def unique_share_notes(tasks: Sequence[Mapping[str, Any]]) -> list[str]:
    """A note for the tasks whose unique share is far from its expectation."""
    sides = [
        unique_share_departure(t["unique_share"], t["expected_unique_share"])
        for t in tasks
    ]
    notes = []
    for where, why in UNIQUE_NOTES.items():
        if names := [t["label"] for t, side in zip(tasks, sides) if side == where]:
            notes.append(f"Far {where} expected for {', '.join(names)}: {why}.")
    return notes


def _per_task(report: Report) -> list[str]:
    rows = []
    for t in report["tasks"]:
        local = t["scale_tensor_local"]
        spread = "–"
        if local["min"] is not None:
            low, high = f"{local['min']:.4f}", f"{local['max']:.4f}"
            spread = f"{local['unique_weighted_mean']:.4f} [{low}, {high}]"
        row = [t["label"], percent(t["changed"], t["elements"])]
        row += [f"{t[k]:,}" for k in ("changed", "unique", "shared")]
        row += [percent(t["unique"], t["changed"], 1), _num(t["rho"], none="inf")]
        scale = _num(t["scale"]) + (" (explicit)" if t["scale_explicit"] else "")
        rows.append([*row, scale, spread])
    notes = [
        "changed % = share of all parameters; unique % = share of the task's "
        "changes no other task makes; rho = shared / unique.",
        "λ global = whole-model statistics (the paper; statistics: global); λ "
        "tensor-local = per-tensor statistics (statistics: tensor), mean over "
        "the task's unique elements [min, max over tensors]. This configuration "
        f"uses the {report['statistics']} one.",
    ]
    headers = (
        "task|changed %|changed|unique|shared|unique %|rho|λ global|λ tensor-local"
    )
    return section("Per task", headers.split("|"), rows, notes)


def _k_way(report: Report) -> list[str]:
    n = len(report["tasks"])
    rows = []
    for t in report["tasks"]:
        hist = (list(t["overlap_histogram"]) + [0] * n)[:n]
        cells = [f"{v:,} ({percent(v, t['changed'], 1)})" for v in hist]
        rows.append([t["label"], *cells])
    headers = ["task"] + ["k=0 (unique)" if k == 0 else f"k={k}" for k in range(n)]
    note = (
        "Each task's changed elements by how many other tasks change them too "
        "(share of the task's changes)."
    )
    return section("k-way overlap", headers, rows, [note])


def _independent(report: Report) -> list[str]:
    pair, labels = report["pairwise"], _labels(report)
    rows = []
    for s in range(len(labels)):
        for t in range(s + 1, len(labels)):
            counts = [f"{pair['intersection'][s][t]:,}"]
            counts += [f"{pair['expected_intersection'][s][t]:,.0f}"]
            jaccard = [f"{pair[k][s][t]:.4f}" for k in ("jaccard", "expected_jaccard")]
            lift = _num(pair["lift"][s][t], 2)
            rows.append([f"{labels[s]} × {labels[t]}", *counts, lift, *jaccard])
    found = {p["supports"] for p in report["verdict"]["pairs"]}
    notes = [
        "Jaccard = |m_s ∧ m_t| / |m_s ∨ m_t| of the change masks; expected = Σ "
        "over tensors of n·d_s·d_t: the overlap of independent random supports "
        "with the same per-tensor densities d; lift = overlap / expected.",
        *(note for kind, note in LIFT_NOTES.items() if kind in found),
    ]
    headers = ["pair", "overlap", "expected", "lift", "Jaccard", "expected J."]
    title = "Overlap against independent supports"
    return section(title, headers, rows, notes) if rows else []


def _retention(report: Report) -> list[str]:
    settings = report["retention"]
    methods = list(settings["methods"]) if settings else []
    rows = [
        [t["label"], _share(t["unique_share"]), _share(t["expected_unique_share"])]
        + [_num((t["retention"] or {}).get(m), 3, "n/a") for m in methods]
        for t in report["tasks"]
    ]
    notes = [
        "unique % = the task's changes no other task makes; expected = the "
        "same for independent supports with the same per-tensor densities.",
        *unique_share_notes(report["tasks"]),
    ]
    if settings:
        plus = settings["ramplus"]
        notes.append(
            "retention = ⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩: how much of the task's "
            "own task vector the merged one keeps (1: all of it, as on its "
            "own; averaging keeps about 1/N of a change no other task makes; "
            "n/a: the task changes nothing). From this pass, no merge or "
            f"evaluation. RAM+: r = {plus['r']:g}, {_rule_text(plus)}, "
            f"{plus['statistics']} statistics; TA 1/N, TA 1: task arithmetic "
            "with weight 1/N, 1 per task."
        )
    headers = ["task", "unique %", "expected"] + [METHODS[m] for m in methods]
    return section("Unique share and retention", headers, rows, notes)


# Per group of tensors: its size, and each task's changed share of its elements;
# per module also its tensors, and the unique share of those changes.
GROUP_NOTES = {
    "module": "Share of the module's parameters each task changes (and the "
    "unique share of those changes).",
    "layer": "Share of each layer's parameters the task changes.",
}


def _grouped(report: Report, field: str) -> list[str]:
    detail = field == "module"
    rows = []
    for e in report[f"per_{field}"]:
        cells = [
            percent(x["changed"], e["elements"])
            + f" ({percent(x['unique'], x['changed'], 0)} unique)" * detail
            for x in e["tasks"]
        ]
        tensors = [str(e["tensors"])] * detail
        rows.append([str(e[field]), *tensors, f"{e['elements']:,}", *cells])
    headers = [field, *["tensors"] * detail, "elements", *_labels(report)]
    return section(f"Per {field}", headers, rows, [GROUP_NOTES[field]]) if rows else []


def _sweep(report: Report) -> list[str]:
    models = [t["model"] for t in report["tasks"]]
    rows = [
        [f"{s['r']:g}"]
        + [f"{s['scale'][m]:.4f} / {_num(s['scale_tensor_local'][m])}" for m in models]
        for s in report["sweep"]
    ]
    notes = [
        f"λ per task for each r ({_rule_text(report)}): global / tensor-local "
        "(mean over unique elements)."
    ]
    if report["r"] == 0:
        notes.append(
            "r = 0 in this configuration (RAM: every λ is 1); the sweep "
            f"shows RAM+ at the paper's r = {PAPER_R:g}. Try --r 0,0.05,0.1,0.2."
        )
    headers = ["r"] + _labels(report)
    return section("λ sweep over r", headers, rows, notes) if rows else []


SECTIONS = (_per_task, _k_way, _independent, _retention)
SECTIONS += (lambda r: _grouped(r, "module"), lambda r: _grouped(r, "layer"), _sweep)


def render_markdown(report: Report) -> str:
    """The report (report.json's document) as Markdown: what was measured,
    the verdict, each table with its notes, and each model's label."""
    lines = [
        "# mergekit-ram analysis",
        "",
        f"Task vectors of {len(report['tasks'])} task model(s) against "
        f"{report['base_model']} ({report['method']} configuration)  ",
        f"{report['num_tensors']} tensors, {report['num_elements']:,} elements; "
        f"epsilon = {report['epsilon']:g}; λ: r = {report['r']:g}, "
        f"{_rule_text(report)}, {report['statistics']} statistics  ",
    ]
    if not is_ours(report["method"]):
        lines.append(
            "Not a ram/ramplus configuration: λ uses the paper's RAM+ defaults.  "
        )
    lines += ["", f"**Verdict:** {report['verdict']['sentence']}"]
    for part in SECTIONS:
        lines += part(report)
    lines += ["", "## Models", ""]
    lines += [f"- {t['label']}: `{t['model']}`" for t in report["tasks"]]
    return "\n".join(lines) + "\n"
