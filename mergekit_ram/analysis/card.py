"""The model card's RAM+ statistics section: the per-agent table, with the
verdict for whole-model statistics or λ's range per agent for tensor-local
ones. `mergekit_ram.commands.install` hands `statistics_section` to the card
hook of `integration.install`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from mergekit_ram.analysis.render import percent, section
from mergekit_ram.analysis.report import Analysis, build_report
from mergekit_ram.core.counting import LocalScales, OverlapStatistics, TaskCounts
from mergekit_ram.core.rule import MergeSettings, SurvivalTally
from mergekit_ram.integration.card import shared_mode, where_from
from mergekit_ram.integration.context import MergeRun
from mergekit_ram.integration.statistics import STATISTICS_FILE

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


def statistics_section(run: MergeRun) -> str:
    """The section for the card of a RAM merge: whole-model statistics when
    it counted them, else tensor-local λ when it computed any, else none."""
    if run.result is not None:
        return card_section(*run.result, run.tally, shared=shared_mode(run.values))
    return local_card_section(run.local, run.tally) if run.local.tasks else ""


def card_section(
    settings: MergeSettings,
    stats: OverlapStatistics,
    scales: Mapping[Hashable, float],
    survival: SurvivalTally | None = None,
    shared: str | None = None,
) -> str:
    """The section for whole-model statistics; `survival`: which share of
    each task's rescaled unique elements the rescale still changes in the
    written model; `shared` keeps the verdict from advising it again."""
    # The verdict reads the report's numbers; the method name plays no part.
    analysis = Analysis(
        "ramplus", None, settings, stats, dict(scales), survival, shared
    )
    verdict = build_report(analysis)["verdict"]["sentence"]
    intro = (
        f"Whole-model overlap statistics (epsilon = {settings.epsilon:g}, "
        f"r = {settings.r:g}, {settings.rule.saturation_text()}) over "
        f"{stats.num_tensors} tensors and {stats.num_elements:,} elements, "
        f"computed by mergekit-ram (a plugin for mergekit, {where_from()}). "
        f"Full counts are in `{STATISTICS_FILE}`.\n\n"
        f"**Verdict:** {verdict}"
    )
    lam = {task: f"{scales.get(task, 1.0):.4f}" for task in stats.tasks}
    return _section("RAM+ statistics", intro, stats.tasks, lam, survival)


def local_card_section(local: LocalScales, survival: SurvivalTally | None) -> str:
    """The section for tensor-local RAM+: each agent's counts summed over the
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
    counts = {} if survival is None else survival.counts
    rows = []
    for task, found in tasks.items():
        rescaled, survived = counts.get(task, (0, 0))
        c, u, s = found.changed, found.unique, found.shared
        rho = "–" if not c else "∞" if not u else f"{s / u:.4f}"  # ∞: S > 0 = U
        shares = [percent(c, found.elements), percent(u, c), percent(s, c), rho]
        rows.append([str(task), *shares, lam[task], percent(survived, rescaled, 1)])
    notes = ["\n".join(CARD_LEGEND)]
    if survival is not None and survival.lost():
        notes.append(survival.warning())
    headers = ["model", "changed", "unique", "shared", "ρ = S/U", "λ", "λ survives"]
    # Unpadded: a card is read rendered, and its bytes are part of the merge's output.
    lines = section(title, headers, rows, notes, [intro], level=3, aligned=False)
    return "\n".join(lines) + "\n"
