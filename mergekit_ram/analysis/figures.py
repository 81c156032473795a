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

INSTALL_HINT = "pip install 'mergekit-ram[plots]'"
DPI = 100
# file name → (width, height) in inches; pixels = inches × DPI.
FIGURES = {
    "overlap_histogram.png": (11.0, 4.5),
    "density_per_layer.png": (8.0, 4.5),
    "jaccard.png": (6.0, 5.0),
    "regime.png": (11.0, 4.5),
}


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError:
        return False
    return True


def _colors(count: int, sequential: bool) -> list:
    """Colours for `count` series: ordered (overlap k) or categorical (tasks)."""
    import matplotlib

    if not sequential and count <= 10:
        return list(matplotlib.colormaps["tab10"].colors[:count])
    colormap = matplotlib.colormaps["viridis"]
    return [colormap(i / max(count - 1, 1)) for i in range(count)]


def overlap_histogram(report: Mapping[str, Any], figure: Any) -> None:
    """Stacked bars per task: changed elements by how many other tasks share them."""
    tasks = report["tasks"]
    n = len(tasks)
    absolute, relative = figure.subplots(1, 2, sharey=True)
    positions = list(range(n))
    colors = _colors(n, sequential=True)
    left_abs, left_rel = [0.0] * n, [0.0] * n
    for k in range(n):
        values = [(t["overlap_histogram"] + [0] * n)[k] for t in tasks]
        part_abs = [
            100.0 * v / t["elements"] if t["elements"] else 0.0
            for v, t in zip(values, tasks)
        ]
        part_rel = [
            100.0 * v / t["changed"] if t["changed"] else 0.0
            for v, t in zip(values, tasks)
        ]
        if k == 0:
            name = "unique (k = 0)"
        else:
            name = (
                f"shared with {k} other" + ("s" if k > 1 else "")
                if n <= 4
                else f"k = {k}"
            )
        absolute.barh(positions, part_abs, left=left_abs, color=colors[k], label=name)
        relative.barh(positions, part_rel, left=left_rel, color=colors[k])
        left_abs = [a + b for a, b in zip(left_abs, part_abs)]
        left_rel = [a + b for a, b in zip(left_rel, part_rel)]
    for y, total in zip(positions, left_abs):
        absolute.text(total, y, f" {total:.1f} %", va="center", fontsize=9)
    absolute.set_yticks(positions, [t["label"] for t in tasks])
    absolute.invert_yaxis()
    absolute.set(
        xlim=(0, max(left_abs + [1.0]) * 1.18), xlabel="% of all parameters changed"
    )
    absolute.set_title("Changed parameters by overlap")
    relative.set(xlim=(0, 100), xlabel="% of the task's changes")
    relative.set_title("Composition of each task's changes")
    figure.legend(loc="outside lower center", ncols=min(n, 7), fontsize=9)
    figure.suptitle(
        f"k-way overlap of the change masks (epsilon = {report['epsilon']:g})"
    )


def density_per_layer(report: Mapping[str, Any], figure: Any) -> None:
    """Share of each layer's parameters every task changes, one line per task."""
    from matplotlib.ticker import MaxNLocator

    tasks, layers = report["tasks"], report["per_layer"]
    axes = figure.subplots()
    for color, task in zip(_colors(len(tasks), sequential=False), tasks):
        ys = []
        for entry in layers:
            row = next((x for x in entry["tasks"] if x["model"] == task["model"]), None)
            changed = row["changed"] if row else 0
            ys.append(100.0 * changed / entry["elements"] if entry["elements"] else 0)
        xs = [entry["layer"] for entry in layers]
        axes.plot(xs, ys, marker="o", color=color, label=task["label"])
        if task["elements"]:
            whole = 100.0 * task["changed"] / task["elements"]
            axes.axhline(whole, color=color, linestyle="--", linewidth=0.8)
    if not layers:
        axes.text(
            0.5, 0.5, "no per-layer tensors", ha="center", transform=axes.transAxes
        )
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set(xlabel="layer", ylabel="% of the layer's parameters changed")
    axes.set_ylim(bottom=0)
    axes.set_title("Task-vector density per layer (dashed: whole model)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=9)


def jaccard(report: Mapping[str, Any], figure: Any) -> None:
    """Pairwise Jaccard overlap of the tasks' change masks."""
    matrix = report["pairwise"]["jaccard"]
    labels = [t["label"] for t in report["tasks"]]
    axes = figure.subplots()
    image = axes.imshow(matrix, vmin=0.0, vmax=1.0, cmap="Blues")
    n = len(matrix)
    digits, size = (3, 10) if n <= 5 else (2, max(5, 48 // n))
    for s, row in enumerate(matrix):
        for t, value in enumerate(row):
            color = "white" if value > 0.6 else "black"
            axes.text(
                t,
                s,
                f"{value:.{digits}f}",
                ha="center",
                va="center",
                color=color,
                fontsize=size,
            )
    ticks = list(range(len(labels)))
    axes.set_xticks(ticks, labels, rotation=30, ha="right")
    axes.set_yticks(ticks, labels)
    axes.set_title("Pairwise overlap of change masks (Jaccard)")
    figure.colorbar(image, ax=axes, shrink=0.8)


def regime(report: Mapping[str, Any], figure: Any) -> None:
    """Left: retention per task and merge method; right: lift per pair."""
    tasks = report["tasks"]
    kept, lifts = figure.subplots(1, 2, width_ratios=[3, 2])
    methods = list(report["retention"]["methods"]) if report["retention"] else []
    width = 0.8 / max(len(methods), 1)
    positions = list(range(len(tasks)))
    drawn = [0.0, 1.0]
    for m, (method, color) in enumerate(
        zip(methods, _colors(len(methods), sequential=False))
    ):
        heights = [(t["retention"] or {}).get(method) or 0.0 for t in tasks]
        offsets = [p + (m - (len(methods) - 1) / 2) * width for p in positions]
        kept.bar(offsets, heights, width, color=color, label=METHODS[method])
        drawn += heights
    kept.set_ylim(
        min(drawn) * 1.1, max(drawn) * 1.3
    )  # room above the bars for the legend
    if methods:
        kept.legend(fontsize=9, ncols=len(methods), loc="upper center")
    else:
        kept.text(
            0.5, 0.5, "retention not computed", ha="center", transform=kept.transAxes
        )
    kept.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    kept.set_xticks(positions, [t["label"] for t in tasks])
    kept.set_ylabel("⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩")
    kept.set_title("How much of each task vector the merge keeps")
    kept.grid(axis="y", alpha=0.3)

    pair = report["pairwise"]
    n = len(tasks)
    names = [
        f"{tasks[s]['label']} × {tasks[t]['label']}"
        for s in range(n)
        for t in range(s + 1, n)
    ]
    values = [pair["lift"][s][t] for s in range(n) for t in range(s + 1, n)]
    shown = [v or 0.0 for v in values]
    lifts.barh(list(range(len(names))), shown, color=_colors(1, sequential=True))
    lifts.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    for y, value in enumerate(values):
        lifts.text(
            shown[y],
            y,
            "n/a" if value is None else f" {value:.2f}",
            va="center",
            fontsize=9,
        )
    if not names:
        lifts.text(
            0.5, 0.5, "one task model: no pairs", ha="center", transform=lifts.transAxes
        )
    lifts.set_yticks(list(range(len(names))), names)
    lifts.invert_yaxis()
    lifts.set(
        xlim=(0, max(shown + [1.0]) * 1.25),
        xlabel="overlap / overlap of independent supports",
    )
    lifts.set_title("Lift (1: independent-like)")
    figure.suptitle("Which regime: support overlap and retention (no evaluation)")


def write_figures(report: Mapping[str, Any], out_dir: str) -> list[str]:
    """Draw every figure of FIGURES into out_dir; returns their file names."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    draw = (overlap_histogram, density_per_layer, jaccard, regime)
    os.makedirs(out_dir, exist_ok=True)
    for name, function in zip(FIGURES, draw):
        figure = Figure(figsize=FIGURES[name], dpi=DPI, layout="constrained")
        FigureCanvasAgg(figure)
        function(report, figure)
        figure.savefig(os.path.join(out_dir, name), dpi=DPI)
    return list(FIGURES)
