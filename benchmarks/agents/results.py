"""results.json (one block per regime), results.md and the figure.

Each regime's block holds its agents' recipes, densities, unique shares and
overlaps next to the paper's, the tuned baselines' grids with the setting
chosen on validation, every row's test accuracy, each merge's paired
difference from the best tuned baseline, and whether the retention ranking
(cheap, no evaluation) orders the merges as their test accuracy does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tasks import TASKS

# Qwen2.5-7B agents in the paper (docs/spec.md): % of parameters changed, and %
# of each agent's changes that are unique; coding, tool use, memory order.
PAPER_PROBE = {"math": (3.2, 6.3), "tool": (46.2, 40.8), "recall": (54.3, 47.5)}
PAPER_NAMES = {"math": "coding", "tool": "tool use", "recall": "memory"}
METRICS = {"accuracy": "se", "reward": "reward_se"}


def average(scores: dict, metric: str = "accuracy") -> tuple[float, float]:
    """Mean of a metric over tasks and its SE (tasks' SEs combined, independent)."""
    error = METRICS[metric]
    values = [scores[task][metric] for task in TASKS]
    se = math.sqrt(sum(scores[task][error] ** 2 for task in TASKS)) / len(TASKS)
    return sum(values) / len(values), se


def _ranks(values: dict[str, float]) -> dict[str, float]:
    """Average ranks (1 = largest), ties sharing their mean rank."""
    ordered = sorted(values, key=lambda name: -values[name])
    ranks: dict[str, float] = {}
    index = 0
    while index < len(ordered):
        end = index
        while (
            end + 1 < len(ordered)
            and values[ordered[end + 1]] == values[ordered[index]]
        ):
            end += 1
        for name in ordered[index : end + 1]:
            ranks[name] = (index + end) / 2 + 1
        index = end + 1
    return ranks


def spearman(a: dict[str, float], b: dict[str, float]) -> float:
    """Spearman rank correlation of two scores over the same names."""
    ra, rb = _ranks(a), _ranks(b)
    names = list(a)
    mean = (len(names) + 1) / 2
    cov = sum((ra[n] - mean) * (rb[n] - mean) for n in names)
    var_a = sum((ra[n] - mean) ** 2 for n in names)
    var_b = sum((rb[n] - mean) ** 2 for n in names)
    return cov / math.sqrt(var_a * var_b) if var_a and var_b else math.nan


def retention_check(block: dict) -> dict:
    """Do the merges' mean retention and test accuracy rank them alike?"""
    mean_retention = {}
    for name, values in block["support"]["retention"].items():
        kept = [value for value in values.values() if value is not None]
        if kept:  # agents that changed nothing have no retention
            mean_retention[name] = sum(kept) / len(kept)
    accuracy = {name: average(block["rows"][name])[0] for name in mean_retention}
    return {
        "mean_retention": mean_retention,
        "test_mean_accuracy": accuracy,
        "spearman": spearman(mean_retention, accuracy),
        "order_by_retention": sorted(mean_retention, key=lambda n: -mean_retention[n]),
        "order_by_accuracy": sorted(accuracy, key=lambda n: -accuracy[n]),
    }


def _row_label(name: str, block: dict) -> str:
    tuned = block["tuned"].get(name)
    return f"{name} ({tuned['chosen']})" if tuned else name


def table_markdown(block: dict, prompts: int) -> str:
    """Rows = models, columns = tasks + average (± SE) + paired difference."""
    header = "| model | " + " | ".join(TASKS) + " | average | vs best tuned (95 % CI) |"
    lines = [header, "|" + "---|" * (len(TASKS) + 3)]
    for name, scores in block["rows"].items():
        cells = [
            f"{100 * scores[t]['accuracy']:.1f} ± {100 * scores[t]['se']:.1f}"
            for t in TASKS
        ]
        mean, se = average(scores)
        paired = block["paired"].get(name)
        versus = (
            f"{100 * paired['difference']:+.1f} "
            f"[{100 * paired['ci95'][0]:+.1f}, {100 * paired['ci95'][1]:+.1f}]"
            if paired
            else ("reference" if name == block["reference"] else "")
        )
        lines.append(
            f"| {_row_label(name, block)} | "
            + " | ".join(cells)
            + f" | {100 * mean:.1f} ± {100 * se:.1f} | {versus} |"
        )
    lines.append("")
    lines.append(
        f"Exact accuracy % ± one binomial SE, greedy, {prompts} test prompts per task. "
        f"Last column: average-over-tasks difference from `{block['reference']}` (the "
        "tuned baseline best on validation; a tie goes to the first in config.yaml), "
        "paired bootstrap over the same prompts."
    )
    return "\n".join(lines) + "\n"


def own_task_markdown(block: dict) -> str:
    """Each agent against the base on its own task (does it learn it?)."""
    lines = [
        "| agent | base % | agent % | gain, points (95 % CI) |",
        "|---|---|---|---|",
    ]
    for task, gain in block["own_task_gain"].items():
        base = block["rows"]["base"][task]["accuracy"]
        agent = block["rows"][f"{task} agent"][task]["accuracy"]
        low, high = gain["ci95"]
        lines.append(
            f"| {task} | {100 * base:.1f} | {100 * agent:.1f} | "
            f"{100 * gain['difference']:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] |"
        )
    lines.append("")
    lines.append(
        "Exact accuracy on the agent's own task, same test prompts; gain "
        "bootstrapped over those prompts, paired."
    )
    return "\n".join(lines) + "\n"


def support_markdown(block: dict) -> str:
    """Densities, unique shares and overlaps (observed vs independent), paper next."""
    support = block["support"]
    lines = [
        "| agent | recipe | changed % | unique % of its changes | unique % if "
        "independent | paper agent: changed % / unique % |",
        "|---|---|---|---|---|---|",
    ]
    for name, stats in support["agents"].items():
        recipe = block["recipes"][name]
        paper = PAPER_PROBE[name]
        lines.append(
            f"| {name} | lr {recipe['lr']:g}, {recipe['steps']} steps, seed "
            f"{recipe['seed']}, {recipe['master']} master"
            + (f", mask {recipe['mask']:g}" if recipe.get("mask", 1) < 1 else "")
            + (
                f", saved {recipe['save']}"
                if recipe.get("save", "bfloat16") != "bfloat16"
                else ""
            )
            + " "
            f"| {100 * stats['density']:.1f} "
            f"| {100 * stats['unique_share']:.1f} "
            f"| {100 * stats['unique_share_expected']:.1f} "
            f"| {PAPER_NAMES[name]}: {paper[0]} / {paper[1]} |"
        )
    lines += [
        "",
        "| pair | overlap (elements) | if independent | lift | Jaccard | "
        "Jaccard if independent |",
        "|---|---|---|---|---|---|",
    ]
    for pair, stats in support["pairs"].items():
        lift = "—" if stats["lift"] is None else f"{stats['lift']:.2f}"
        lines.append(
            f"| {pair} | {stats['overlap']:,} | {stats['overlap_expected']:,.0f} | "
            f"{lift} | {stats['jaccard']:.3f} | "
            f"{stats['jaccard_expected']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def retention_markdown(block: dict) -> str:
    check = block["retention_check"]
    retention = block["support"]["retention"]
    lines = [
        "| merge | "
        + " | ".join(f"kept of {t}" for t in TASKS)
        + " | mean | test average % |",
        "|" + "---|" * (len(TASKS) + 3),
    ]
    for name in check["order_by_retention"]:
        kept = [retention[name][t] for t in TASKS]
        lines.append(
            f"| {name} | "
            + " | ".join("—" if k is None else f"{k:.3f}" for k in kept)
            + f" | {check['mean_retention'][name]:.3f} | "
            f"{100 * check['test_mean_accuracy'][name]:.1f} |"
        )
    lines.append("")
    lines.append(
        "kept = ⟨τ_merge, τ_t⟩ / ⟨τ_t, τ_t⟩ over every parameter. Spearman rank "
        f"correlation of mean kept vs test average: {check['spearman']:.2f}."
    )
    return "\n".join(lines) + "\n"


def grid_markdown(block: dict) -> str:
    lines = [
        "| baseline | setting | validation average % | chosen |",
        "|---|---|---|---|",
    ]
    for name, tuned in block["tuned"].items():
        for setting, trial in tuned["grid"].items():
            chosen = "yes" if setting == tuned["chosen"] else ""
            mean = 100 * trial["validation_mean"]
            lines.append(f"| {name} | {setting} | {mean:.1f} | {chosen} |")
    return "\n".join(lines) + "\n"


def write_figure(document: dict, path: Path) -> None:
    """Average test accuracy per model, one panel per regime, SE error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = document["regimes"]
    figure, axes = plt.subplots(
        1, len(blocks), figsize=(6.5 * len(blocks), 4.4), squeeze=False
    )
    for axis, (regime, block) in zip(axes[0], blocks.items()):
        names = list(block["rows"])
        width = 0.8 / (len(TASKS) + 1)
        for index, task in enumerate([*TASKS, "average"]):
            heights, errors = [], []
            for name in names:
                scores = block["rows"][name]
                if task == "average":
                    mean, se = average(scores)
                else:
                    mean, se = scores[task]["accuracy"], scores[task]["se"]
                heights.append(100 * mean)
                errors.append(100 * se)
            offset = (index - len(TASKS) / 2) * width
            positions = [i + offset for i in range(len(names))]
            axis.bar(positions, heights, width, yerr=errors, capsize=1.5, label=task)
        axis.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
        axis.set_ylabel("test exact accuracy (%)")
        axis.set_title(f"{regime} agents")
        axis.legend(ncol=4, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def keep_earlier_regimes(
    document: dict, out_dir: Path, regimes: list[str]
) -> list[str]:
    """Add to document the blocks of out_dir/results.json for regimes of the
    config not run now (one regime can be rerun without the others' caches);
    only when both were scored on as many prompts. Returns the names kept."""
    path = out_dir / "results.json"
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    counts = ("test_prompts_per_task", "validation_prompts_per_task")
    if any(earlier.get(count) != document[count] for count in counts):
        return []
    kept = [
        regime
        for regime in regimes
        if regime not in document["regimes"] and regime in earlier["regimes"]
    ]
    blocks = {**document["regimes"], **{r: earlier["regimes"][r] for r in kept}}
    document["regimes"] = {r: blocks[r] for r in regimes if r in blocks}
    return kept


def write_results(document: dict, out_dir: Path) -> list[Path]:
    """results.json, results.md and table1.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = document["test_prompts_per_task"]
    parts = []
    for regime, block in document["regimes"].items():
        block["retention_check"] = retention_check(block)
        parts += [
            f"# {regime}\n",
            "## Test accuracy\n",
            table_markdown(block, prompts),
            *(
                ["## Each agent on its own task\n", own_task_markdown(block)]
                if "own_task_gain" in block
                else []
            ),
            "## Baselines tuned on validation "
            f"({document['validation_prompts_per_task']} prompts per task)\n",
            grid_markdown(block),
            "## Agents' supports\n",
            support_markdown(block),
            "## Retention vs evaluation\n",
            retention_markdown(block),
        ]
    paths = [out_dir / "results.json", out_dir / "results.md", out_dir / "table1.png"]
    paths[0].write_text(json.dumps(document, indent=1) + "\n")
    paths[1].write_text("\n".join(parts))
    write_figure(document, paths[2])
    return paths
