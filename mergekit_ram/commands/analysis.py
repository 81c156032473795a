"""`mergekit-ram analyze`: the statistics of a configuration's task vectors.

The analysis plans the configuration exactly as a merge would (mergekit's
MergePlanner, without our RAM+ hook so nothing is counted twice) and runs the
one statistics engine (integration.statistics) over the planned groups:
every tensor group is read once, counted, and dropped. The report
(analysis.report) is derived from the resulting OverlapStatistics alone, so
`mergekit-ram merge --report` can build the very same report from the
statistics its merge already computed.

Settings. For `ram` / `ramplus` configurations epsilon, r, alpha, saturation
and statistics are resolved as the merge resolves them (`ram` means r = 0:
every λ is 1, and the report then adds an r sweep at the paper's r = 0.1).
For any other merge method only the models and the base matter and the paper
defaults are used (epsilon 1e-5, r 0.1, alpha 2, clip, global). `--epsilon`
overrides epsilon in both cases.

The same pass sums the task vectors' inner products (core.counting.Products), so the
report also says how much of each task vector RAM, RAM+ and task arithmetic
would keep, without merging or a second read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mergekit_ram.analysis.report import PAPER_DEFAULTS, Analysis
from mergekit_ram.commands.install import install
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.card import shared_mode
from mergekit_ram.integration.context import merge_run
from mergekit_ram.integration.methods import is_ours
from mergekit_ram.integration.statistics import count_planned, plan_merges
from mergekit_ram.integration.validation import Findings, check_plan, resolved_values


def analyze_config(
    config: Any,
    options: Any,
    *,
    epsilon: float | None = None,
    findings: Findings | None = None,
) -> Analysis:
    """Plan `config` and run the statistics engine once over its tensors, with
    the settings (checked as the merge checks them, `findings`' warnings with)
    and explicit unique_scale the merge would use; `epsilon` overrides."""
    install()
    merges = plan_merges(config, options)
    if not merges:
        raise ValueError("the configuration plans no tensors")
    base = merges[0].base_model
    if base is None:
        raise ValueError(
            "analyze needs a base_model: task vectors are measured from it"
        )
    ours = is_ours(config.merge_method)
    settings, explicit = (
        check_plan(list(merges), findings) if ours else (PAPER_DEFAULTS, {})
    )
    if epsilon is not None:
        settings = replace(settings, epsilon=float(epsilon))
    counting = dict(desc="Analyzing task vectors", inner_products=True)
    stats, scales = count_planned(merges, settings, explicit, options, **counting)
    reference = str(base if config.base_model is None else config.base_model)
    found = Analysis(config.merge_method, reference, settings, stats, scales)
    found.shared = shared_mode(resolved_values(merges)) if ours else None
    return require_task_vectors(found, len(merges))


def require_task_vectors(analysis: Analysis, planned: int | None = None) -> Analysis:
    """The analysis, or a RAMInputError when no tensor had a task vector.

    Only floating-point tensors have one (integer and bool buffers are copied
    from the base); with none there is nothing to report. `planned`: how many
    tensors the configuration merges, when known.
    """
    if analysis.stats.tasks:
        return analysis
    tensors = "tensors" if planned is None else f"{planned} tensor(s)"
    raise RAMInputError(
        f"Nothing to analyse: none of the {tensors} the configuration merges is "
        f"floating point in the base model {analysis.base_model}, so there is no "
        "task vector θ_t − θ₀ to measure (integer and bool tensors are copied "
        "from the base, never merged). Point base_model and models at "
        "checkpoints with floating-point weights."
    )


def merge_with_analysis(
    config: Any,
    out_path: str,
    options: Any,
    config_source: str,
    echo: Callable[[str], None] = print,
) -> Analysis:
    """Merge, and return the analysis of its inputs from the statistics the
    merge's planner counted (it counts whenever a report is asked). Another
    method's merge is not ours to plan: its inputs are read once more, and
    `echo` says so."""
    from mergekit_ram.commands.api import run_merge

    if not is_ours(config.merge_method):  # mergekit's merge, untouched
        run_merge(config, out_path, options=options, config_source=config_source)
        echo(
            f"merge_method {config.merge_method} is not RAM: reading the models once "
            "more for the report."
        )
        return analyze_config(config, options)
    with merge_run() as run:
        run.inner_products = True
        run_merge(config, out_path, options=options, config_source=config_source)
    return require_task_vectors(Analysis.from_merge(config, run))
