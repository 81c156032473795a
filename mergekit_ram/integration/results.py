"""What a RAM+ merge leaves behind: ram_statistics.json and the model card
(its RAM+ section with the verdict, the variant in its Merge Method heading,
the base model's licence, and its model list in the configuration's order)."""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Mapping
from importlib import metadata
from typing import Any

import huggingface_hub
import yaml
from mergekit import merge_methods
from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration

from mergekit_ram.core.counting import LocalScales, OverlapStatistics, TaskCounts
from mergekit_ram.core.settings import MergeSettings
from mergekit_ram.core.survival import SurvivalTally
from mergekit_ram.core.verdict import verdict_of
from mergekit_ram.integration.config_groups import groups
from mergekit_ram.integration.model_locations import model_references
from mergekit_ram.integration.parameter_schema import _possible
from mergekit_ram.integration.tables import markdown_table, percent

STATISTICS_FILE = "ram_statistics.json"


def task_rows(
    stats: OverlapStatistics, scales: Mapping[Hashable, float]
) -> list[dict[str, Any]]:
    """Per task: model, changed, shared, unique, overlap_histogram, rho, scale.

    rho is null when the task has shared but no unique elements (ρ = ∞).
    """
    rows = []
    for task, counts in stats.tasks.items():
        rho = counts.rho
        rows.append(
            {
                "model": str(task),
                "elements": counts.elements,
                "changed": counts.changed,
                "shared": counts.shared,
                "unique": counts.unique,
                "overlap_histogram": list(counts.histogram),
                "rho": rho if math.isfinite(rho) else None,
                "scale": scales.get(task, 1.0),
            }
        )
    return rows


def statistics_document(
    settings: MergeSettings,
    stats: OverlapStatistics,
    scales: Mapping[Hashable, float],
) -> dict[str, Any]:
    """The content of ram_statistics.json."""
    return {
        **settings.as_dict(),
        "num_tensors": stats.num_tensors,
        "num_elements": stats.num_elements,
        "seconds": round(stats.seconds, 3),
        "tasks": task_rows(stats, scales),
    }


def with_survival(
    document: dict[str, Any], tally: SurvivalTally | None
) -> dict[str, Any]:
    """ram_statistics.json's content plus, per task, how many unique elements
    were rescaled (λ ≠ 1) and how many of them still differ from RAM once
    written (`rescale_survived`); both 0 when nothing was rescaled. With no
    tally nothing was counted (analyze merges nothing; a merge whose λ are all
    1 rescales nothing) and the fields are null, for report.json."""
    counts = {} if tally is None else {str(t): e for t, e in tally.counts.items()}
    missing = (None, None) if tally is None else (0, 0)
    for row in document["tasks"]:
        rescaled, survived = counts.get(row["model"], missing)
        row["rescaled"] = rescaled
        row["rescale_survived"] = survived
    document["written_dtypes"] = None if tally is None else sorted(tally.dtypes)
    return document


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float as None, so json.dumps(...,
    allow_nan=False) writes standard JSON (`null`) instead of Infinity / NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


# What the card's columns are shares of, one line each (Markdown list).
CARD_LEGEND = (
    "- *changed*: the parameters the agent changes (|θ_t − θ₀| > epsilon), "
    "as a share of all the parameters (elements) counted above.",
    "- *unique* / *shared*: shares of that agent's own changes that no other "
    "agent makes / that at least one other agent makes too.",
    "- *ρ = S/U*: its shared changes per unique one; *λ*: the factor RAM+ "
    "multiplies its unique changes by.",
    "- *λ survives*: the share of the agent's λ-scaled unique elements whose "
    "written value, rounded to the output dtype, still differs from plain RAM's "
    "(λ = 1); – when none was scaled.",
)


def card_section(
    settings: MergeSettings,
    stats: OverlapStatistics,
    scales: Mapping[Hashable, float],
    survival: SurvivalTally | None = None,
) -> str:
    """A short model-card section with the per-agent table.

    With a survival tally, a column says which share of each task's rescaled
    unique elements the rescale still changes in the written model.
    """
    intro = (
        f"Whole-model overlap statistics (epsilon = {settings.epsilon:g}, "
        f"r = {settings.r:g}, {settings.rule.saturation_text()}) over "
        f"{stats.num_tensors} tensors and {stats.num_elements:,} elements, "
        f"computed by mergekit-ram (a plugin for mergekit, {where_from()}). "
        f"Full counts are in `{STATISTICS_FILE}`.\n\n"
        f"**Verdict:** {verdict_of(stats).sentence}"
    )
    lam = {task: f"{scales.get(task, 1.0):.4f}" for task in stats.tasks}
    return _section("RAM+ statistics", intro, stats.tasks, lam, survival)


def local_card_section(local: LocalScales, survival: SurvivalTally | None) -> str:
    """The card's section for tensor-local RAM+: each tensor's λ came from
    its own overlap, so the table shows each agent's counts summed over the
    tensors and the range of λ they gave it."""
    elements = max((counts.elements for counts in local.tasks.values()), default=0)
    intro = (
        f"Tensor-local RAM+ (statistics: tensor): every tensor's λ comes from "
        f"that tensor's own overlap, over {len(local.names)} tensors and "
        f"{elements:,} elements; the counts below are summed over them, and λ "
        "is the smallest to the largest a tensor gave the agent. Computed by "
        f"mergekit-ram (a plugin for mergekit, {where_from()})."
    )
    lam = {
        task: f"{low:.4f}" if low == high else f"{low:.4f}–{high:.4f}"
        for task, (low, high) in local.scales.items()
    }
    return _section("RAM+ statistics (tensor-local)", intro, local.tasks, lam, survival)


def _section(
    title: str,
    intro: str,
    tasks: Mapping[Hashable, TaskCounts],
    lam: Mapping[Hashable, str],
    survival: SurvivalTally | None,
) -> str:
    """A card section: a title, its introduction, the per-agent table, the legend."""
    counts = {} if survival is None else survival.counts
    rows = []
    for task, found in tasks.items():
        rescaled, survived = counts.get(task, (0, 0))
        rho = found.rho
        rows.append(
            [
                str(task),
                percent(found.changed, found.elements),
                percent(found.unique, found.changed),
                percent(found.shared, found.changed),
                "∞" if not math.isfinite(rho) else f"{rho:.4f}",
                lam[task],
                percent(survived, rescaled, 1),
            ]
        )
    headers = ["model", "changed", "unique", "shared", "ρ = S/U", "λ", "λ survives"]
    lines = ["", f"### {title}", "", intro, ""]
    lines += markdown_table(headers, rows)
    lines += ["", *CARD_LEGEND]
    if survival is not None and survival.lost():
        lines += ["", survival.warning()]
    return "\n".join(lines) + "\n"


def repository_url() -> str | None:
    """The repository address the installed package declares (pyproject's
    [project.urls]), if it declares one."""
    try:
        entries = metadata.metadata("mergekit-ram").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    urls = dict(entry.split(", ", 1) for entry in entries if ", " in entry)
    for label in ("Repository", "Source", "Homepage"):
        if label in urls:
            return urls[label]
    return None


def where_from() -> str:
    """Where a reader of the card gets mergekit-ram (it is not on PyPI)."""
    url = repository_url()
    if url is None:
        return "not on PyPI: installed from a clone of its repository"
    return f"not on PyPI: install it from its repository, {url}"


# How each `shared` mode is named in the card's heading.
SHARED_MODES = ("mean", "ties", "base")


def variant(config: MergeConfiguration) -> str:
    """The RAM variant a configuration merges with, for the card's heading:
    RAM or RAM+, the statistics scope and rule (RAM+), and `shared`."""
    specs = {p.name: p for p in merge_methods.get(config.merge_method).spec.parameters}
    values: dict[str, set[Any]] = {
        name: set() for name in ("r", "statistics", "saturation", "shared")
    }
    for group in groups(config):
        for name, found in values.items():
            found |= _possible(specs[name], group.blocks)

    def one(name: str, words: Mapping[Any, str]) -> str:
        if len(values[name]) == 1:
            return words[next(iter(values[name]))]
        return f"{name} varies per tensor"

    parts = []
    if any(r > 0 for r in values["r"]):
        name = "RAM+" if all(r > 0 for r in values["r"]) else "RAM / RAM+"
        scopes = {"global": "global statistics", "tensor": "tensor-local statistics"}
        parts += [
            one("statistics", scopes),
            one("saturation", {"clip": "clip rule", "soft": "soft rule"}),
        ]
    else:
        name = "RAM"
    parts.append(one("shared", {mode: f"`shared: {mode}`" for mode in SHARED_MODES}))
    return f"{name} ({', '.join(parts)})"


def base_license(config: MergeConfiguration) -> str | None:
    """The licence the base model's card (README.md front matter) states:
    a local folder's, or a hub model's already in the local cache (no
    download). None when there is none to read."""
    if config.base_model is None:
        return None
    location = config.base_model.model
    readme = os.path.join(location.path, "README.md")
    try:
        if not os.path.isdir(location.path):
            cached = huggingface_hub.try_to_load_from_cache(
                location.path, "README.md", revision=location.revision
            )
            readme = cached if isinstance(cached, str) else ""
        with open(readme, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, ValueError):  # no such file; not a valid hub id
        return None
    front = front_matter(text)
    value = None if front is None else front[0].get("license")
    return value if isinstance(value, str) and value.strip() else None


def front_matter(card: str) -> tuple[dict[str, Any], int] | None:
    """A card's YAML front matter and the offset of its closing `---` line;
    None without one (or when it is not a mapping)."""
    if not card.startswith("---\n"):
        return None
    end = card.find("\n---", 3)
    if end < 0:
        return None
    try:
        data = yaml.safe_load(card[4:end])
    except yaml.YAMLError:
        return None
    return (data, end) if isinstance(data, dict) else None


def described_card(card: str, config: MergeConfiguration) -> str:
    """mergekit's card for a RAM merge, with the variant in its Merge Method
    heading and the base model's licence in its metadata (mergekit writes
    neither)."""
    card = card.replace(
        "### Merge Method\n", f"### Merge Method: {variant(config)}\n", 1
    )
    license_ = base_license(config)
    front = front_matter(card)
    if license_ is None or front is None or "license" in front[0]:
        return card
    end = front[1]
    entry = yaml.safe_dump({"license": license_}).rstrip("\n")
    return card[:end].rstrip("\n") + "\n" + entry + card[end:]


class _InConfigOrder(MergeConfiguration):
    """A configuration whose referenced_models() follows the configuration."""

    def referenced_models(self) -> list[ModelReference]:
        found = model_references(self, groups(self))
        position = {reference: index for index, (_, reference) in enumerate(found)}
        return sorted(
            super().referenced_models(), key=lambda m: position.get(m, len(position))
        )


def in_config_order(config: MergeConfiguration) -> MergeConfiguration:
    """`config` as mergekit's card should see it: the card lists
    referenced_models(), a set in mergekit, so its model list (and its
    `base_model` metadata) changed order from run to run."""
    return _InConfigOrder.model_construct(**dict(config))
