"""PNG figures of an analysis report (the `plots` extra: matplotlib).

matplotlib is imported only when a figure is drawn, and only through its
object-oriented API with the Agg canvas: no pyplot, no global backend switch,
no display needed. Sizes are fixed (FIGURES, in inches at DPI) so the files
are reproducible.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mergekit_ram.analysis.regime import METHODS

Report = Mapping[str, Any]
INSTALL_HINT = "pip install 'mergekit-ram[plots]'"
DPI = 100
# file name → (width, height) in inches; pixels = inches × DPI.
FIGURES = {
    "overlap_histogram.png": (11.0, 4.5),
    "density_per_layer.png": (8.0, 4.5),
    "jaccard.png": (6.0, 5.0),
    "regime.png": (11.0, 4.5),
}


def _colors(count: int, sequential: bool) -> list:
    """Colours for `count` series: ordered (overlap k) or categorical (tasks)."""
    import matplotlib

    if not sequential and count <= 10:
        return list(matplotlib.colormaps["tab10"].colors[:count])
    colormap = matplotlib.colormaps["viridis"]
    return [colormap(i / max(count - 1, 1)) for i in range(count)]


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


def _note(axes: Any, text: str) -> None:
    """A line in the middle of an empty plot, saying why it is empty."""
    axes.text(0.5, 0.5, text, ha="center", transform=axes.transAxes)


def overlap_histogram(report: Report, figure: Any) -> None:
    """Stacked bars per task: changed elements by how many other tasks share them."""
    tasks, n = report["tasks"], len(report["tasks"])
    absolute, relative = figure.subplots(1, 2, sharey=True)
    positions = list(range(n))
    left_abs, left_rel = [0.0] * n, [0.0] * n
    for k, color in enumerate(_colors(n, sequential=True)):
        values = [(t["overlap_histogram"] + [0] * n)[k] for t in tasks]
        part_abs = [_pct(v, t["elements"]) for v, t in zip(values, tasks)]
        part_rel = [_pct(v, t["changed"]) for v, t in zip(values, tasks)]
        name = f"shared with {k} other" + "s" * (k > 1) if n <= 4 else f"k = {k}"
        name = "unique (k = 0)" if k == 0 else name
        absolute.barh(positions, part_abs, left=left_abs, color=color, label=name)
        relative.barh(positions, part_rel, left=left_rel, color=color)
        left_abs = [a + b for a, b in zip(left_abs, part_abs)]
        left_rel = [a + b for a, b in zip(left_rel, part_rel)]
    for y, total in zip(positions, left_abs):
        absolute.text(total, y, f" {total:.1f} %", va="center", fontsize=9)
    absolute.set_yticks(positions, [t["label"] for t in tasks])
    absolute.invert_yaxis()
    top = max(left_abs + [1.0]) * 1.18
    absolute.set(xlim=(0, top), title="Changed parameters by overlap")
    absolute.set_xlabel("% of all parameters changed")
    relative.set(xlim=(0, 100), xlabel="% of the task's changes")
    relative.set_title("Composition of each task's changes")
    figure.legend(loc="outside lower center", ncols=min(n, 7), fontsize=9)
    epsilon = report["epsilon"]
    figure.suptitle(f"k-way overlap of the change masks (epsilon = {epsilon:g})")


def density_per_layer(report: Report, figure: Any) -> None:
    """Share of each layer's parameters every task changes, one line per task."""
    from matplotlib.ticker import MaxNLocator

    tasks, layers = report["tasks"], report["per_layer"]
    axes = figure.subplots()
    xs = [entry["layer"] for entry in layers]
    for i, (color, task) in enumerate(zip(_colors(len(tasks), False), tasks)):
        ys = [_pct(e["tasks"][i]["changed"], e["elements"]) for e in layers]
        axes.plot(xs, ys, marker="o", color=color, label=task["label"])
        if task["elements"]:
            whole = _pct(task["changed"], task["elements"])
            axes.axhline(whole, color=color, linestyle="--", linewidth=0.8)
    if not layers:
        _note(axes, "no per-layer tensors")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(
        xlabel="layer", ylabel="% of the layer's parameters changed", ylim=(0, None)
    )
    axes.set_title("Task-vector density per layer (dashed: whole model)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=9)


def jaccard(report: Report, figure: Any) -> None:
    """Pairwise Jaccard overlap of the tasks' change masks."""
    matrix = report["pairwise"]["jaccard"]
    labels = [t["label"] for t in report["tasks"]]
    axes = figure.subplots()
    image = axes.imshow(matrix, vmin=0.0, vmax=1.0, cmap="Blues")
    n = len(matrix)
    digits, size = (3, 10) if n <= 5 else (2, max(5, 48 // n))
    for s, row in enumerate(matrix):
        for t, value in enumerate(row):
            style = dict(color="white" if value > 0.6 else "black", fontsize=size)
            axes.text(t, s, f"{value:.{digits}f}", ha="center", va="center", **style)
    axes.set_xticks(range(n), labels, rotation=30, ha="right")
    axes.set_yticks(range(n), labels)
    axes.set_title("Pairwise overlap of change masks (Jaccard)")
    figure.colorbar(image, ax=axes, shrink=0.8)


def regime(report: Report, figure: Any) -> None:
    """Left: retention per task and merge method; right: lift per pair."""
    tasks, n = report["tasks"], len(report["tasks"])
    kept, lifts = figure.subplots(1, 2, width_ratios=[3, 2])
    methods = list(report["retention"]["methods"]) if report["retention"] else []
    width = 0.8 / max(len(methods), 1)
    drawn = [0.0, 1.0]
    for m, (method, color) in enumerate(zip(methods, _colors(len(methods), False))):
        heights = [(t["retention"] or {}).get(method) or 0.0 for t in tasks]
        offsets = [p + (m - (len(methods) - 1) / 2) * width for p in range(n)]
        kept.bar(offsets, heights, width, color=color, label=METHODS[method])
        drawn += heights
    kept.set_ylim(min(drawn) * 1.1, max(drawn) * 1.3)  # room for the legend
    if methods:
        kept.legend(fontsize=9, ncols=len(methods), loc="upper center")
    else:
        _note(kept, "retention not computed")
    kept.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    kept.set_xticks(range(n), [t["label"] for t in tasks])
    kept.set(ylabel="⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩")
    kept.set_title("How much of each task vector the merge keeps")
    kept.grid(axis="y", alpha=0.3)

    pairs = [(s, t) for s in range(n) for t in range(s + 1, n)]
    names = [f"{tasks[s]['label']} × {tasks[t]['label']}" for s, t in pairs]
    values = [report["pairwise"]["lift"][s][t] for s, t in pairs]
    shown = [v or 0.0 for v in values]
    lifts.barh(range(len(names)), shown, color=_colors(1, sequential=True))
    lifts.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    for y, value in enumerate(values):
        text = "n/a" if value is None else f" {value:.2f}"
        lifts.text(shown[y], y, text, va="center", fontsize=9)
    if not names:
        _note(lifts, "one task model: no pairs")
    lifts.set_yticks(range(len(names)), names)
    lifts.invert_yaxis()
    lifts.set(xlim=(0, max(shown + [1.0]) * 1.25), title="Lift (1: independent-like)")
    lifts.set_xlabel("overlap / overlap of independent supports")
    figure.suptitle("Which regime: support overlap and retention (no evaluation)")


def write_figures(report: Report, out_dir: str) -> list[str]:
    """Draw every figure of FIGURES into out_dir; returns their file names,
    none without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return []

    draw = (overlap_histogram, density_per_layer, jaccard, regime)
    os.makedirs(out_dir, exist_ok=True)
    for name, function in zip(FIGURES, draw):
        figure = Figure(figsize=FIGURES[name], dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        function(report, figure)
        figure.savefig(os.path.join(out_dir, name), dpi=DPI)
    return list(FIGURES)
