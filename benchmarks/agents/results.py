"""The mini Table 1 (markdown + JSON), its figure, and the probe next to the paper."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tasks import TASKS

# Qwen2.5-7B agents in the paper (docs/spec.md): % of parameters changed, and %
# of each agent's changes that are unique; coding, tool use, memory order.
PAPER_PROBE = {"math": (3.2, 6.3), "tool": (46.2, 40.8), "recall": (54.3, 47.5)}


METRICS = {"accuracy": "se", "reward": "reward_se"}


def average(scores: dict, metric: str = "accuracy") -> tuple[float, float]:
    """Mean of a metric over tasks and its SE (tasks' SEs combined, independent)."""
    error = METRICS[metric]
    values = [scores[task][metric] for task in TASKS]
    se = math.sqrt(sum(scores[task][error] ** 2 for task in TASKS)) / len(TASKS)
    return sum(values) / len(values), se


def table_markdown(
    rows: dict[str, dict], prompts: int, metric: str = "accuracy"
) -> str:
    """Rows = models, columns = tasks + average, metric % ± SE."""
    error = METRICS[metric]
    header = "| model | " + " | ".join(TASKS) + " | average |"
    lines = [header, "|" + "---|" * (len(TASKS) + 2)]
    for model, scores in rows.items():
        cells = [
            f"{100 * scores[t][metric]:.1f} ± {100 * scores[t][error]:.1f}"
            for t in TASKS
        ]
        mean, se = average(scores, metric)
        lines.append(
            f"| {model} | "
            + " | ".join(cells)
            + f" | {100 * mean:.1f} ± {100 * se:.1f} |"
        )
    lines.append("")
    what = (
        "exact accuracy % ± one binomial standard error"
        if metric == "accuracy"
        else "mean reward × 100 ± one standard error (tool: partial credit)"
    )
    lines.append(f"Greedy decoding, {prompts} held-out prompts per task; {what}.")
    return "\n".join(lines) + "\n"


def probe_markdown(report: dict) -> str:
    """Per-agent density and uniqueness from the analyze report, next to the paper."""
    lines = [
        "| agent | changed % (ours) | unique % of changes (ours) | λ (RAM+ global) "
        "| paper agent | changed % | unique % |",
        "|---|---|---|---|---|---|---|",
    ]
    paper_names = {"math": "coding", "tool": "tool use", "recall": "memory"}
    for task in report["tasks"]:
        name = task["label"]
        changed = 100 * task["changed"] / task["elements"]
        unique = 100 * task["unique"] / task["changed"] if task["changed"] else 0.0
        paper_changed, paper_unique = PAPER_PROBE.get(name, (math.nan, math.nan))
        lines.append(
            f"| {name} | {changed:.1f} | {unique:.1f} | {task['scale']:.3f} | "
            f"{paper_names.get(name, '?')} | {paper_changed} | {paper_unique} |"
        )
    return "\n".join(lines) + "\n"


def write_figure(rows: dict[str, dict], path: Path) -> None:
    """Grouped bars: accuracy per task for every model, with SE error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [*TASKS, "average"]
    width = 0.8 / len(tasks)
    figure, axes = plt.subplots(figsize=(max(8, 0.7 * len(rows)), 4.2))
    for index, task in enumerate(tasks):
        heights, errors = [], []
        for scores in rows.values():
            if task == "average":
                mean, se = average(scores)
            else:
                mean, se = scores[task]["accuracy"], scores[task]["se"]
            heights.append(100 * mean)
            errors.append(100 * se)
        positions = [
            i + (index - (len(tasks) - 1) / 2) * width for i in range(len(rows))
        ]
        axes.bar(positions, heights, width, yerr=errors, capsize=2, label=task)
    axes.set_xticks(range(len(rows)), list(rows), rotation=35, ha="right")
    axes.set_ylabel("held-out accuracy (%)")
    axes.set_title("Three RL agents from SmolLM2-135M-Instruct and their merges")
    axes.legend(ncol=len(tasks), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_results(
    rows: dict[str, dict], report: dict, prompts: int, out_dir: Path, extra: dict
) -> list[Path]:
    """results.json, results.md and table1.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    document = {"eval_prompts": prompts, "rows": rows, **extra}
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "table1.png"]
    paths[0].write_text(json.dumps(document, indent=1) + "\n")
    paths[1].write_text(
        "## Accuracy\n\n"
        + table_markdown(rows, prompts)
        + "\n## Mean reward\n\n"
        + table_markdown(rows, prompts, "reward")
        + "\n## Probe (`mergekit-ram analyze`)\n\n"
        + probe_markdown(report)
    )
    write_figure(rows, paths[2])
    return paths
