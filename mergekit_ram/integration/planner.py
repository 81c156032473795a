"""Global RAM+ inside mergekit's planner: count, then hand λ to every merge task.

`MergePlanner._plan` is wrapped so that, once mergekit has planned a `ram` or
`ramplus` merge, the statistics pass (`statistics_pass`) runs over the
planner's own gather tasks and each planned merge task gets the resulting λ
as its models' `unique_scale`. Every entry point (mergekit-yaml, mergekit-ram
merge, the Python run_merge) plans through this class, so all of them compute
the same numbers. Each planned merge task becomes a `RAMMergeTask`, which
applies RAM's input rules before mergekit's own checks. `plan_to_disk`
additionally gets a last task that writes ram_statistics.json once the model
has been finalized (into the staging folder of `publishing`, published only
when the whole merge succeeded). The result also goes to the merge in
progress (`context.MergeRun`), for the model card and for a caller that asked
for it (`mergekit-ram merge --report` reuses the merge's statistics that way
instead of a second pass). A merge that may rescale unique elements also
gets a `SurvivalTally` in its run: each merge task counts into it how much of
λ survives the dtype it writes, and the last task adds that to
ram_statistics.json and says in one line when the rescale was mostly lost.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import immutables
from mergekit.graph import Task
from mergekit.io.tasks import FinalizeModel
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from mergekit.plan import MergePlanner
from pydantic import PrivateAttr

from mergekit_ram.core.checks import check_layout
from mergekit_ram.core.survival import SurvivalTally
from mergekit_ram.integration.context import (
    MergeRun,
    checked_inputs,
    current_run,
    running,
)
from mergekit_ram.integration.methods import is_ours
from mergekit_ram.integration.results import (
    STATISTICS_FILE,
    statistics_document,
    strict_json,
    with_survival,
)
from mergekit_ram.integration.statistics_pass import count_planned, planned_settings

LOG = logging.getLogger("mergekit_ram")


class RAMMergeTask(ExecuteMergeMethodTask):
    """mergekit's merge task, with RAM's input rules before mergekit's checks.

    A non-float base tensor (an integer or bool buffer) is passed through as
    the base has it, even where a task model's differs (mergekit would
    refuse); mismatched shapes fail with a RAMInputError naming the models
    and, for a vocabulary axis, pointing to tokenizer_source. Its
    out_dtype is the dtype the tensor is written in. It carries the merge it
    belongs to (a private attribute: not part of the task's identity) and
    runs inside it, also on a worker thread, so the method finds the run's
    survival tally. `_checked`: the statistics pass already checked its
    inputs for NaN/Inf (set by with_scales), so the merge skips that check
    under `nonfinite: refuse`.
    """

    _run: MergeRun | None = PrivateAttr(default=None)
    _checked: bool = PrivateAttr(default=False)

    def execute(self, tensors: dict, **kwargs: Any) -> Any:
        base = tensors.get(self.base_model)
        if base is not None:
            if not base.is_floating_point():
                return base
            weight = self.output_weight
            check_layout(weight.name, tensors, self.base_model, weight.vocabulary_axis)
        with running(self._run), checked_inputs(self._checked):
            return super().execute(tensors, **kwargs)


def as_ram_task(
    task: ExecuteMergeMethodTask, out_dtype: str | None, run: MergeRun | None
) -> RAMMergeTask:
    """The same planned merge as a RAMMergeTask of `run`, writing `out_dtype`."""
    fields = type(task).model_fields
    values = {name: getattr(task, name) for name in fields}
    ram_task = RAMMergeTask(**{**values, "out_dtype": out_dtype})
    ram_task._run = run
    return ram_task


class WriteStatistics(Task[None]):
    """After the weights are finalized: write ram_statistics.json (with λ's
    survival) and say in one line when the rescale was mostly lost."""

    out_path: str
    document: str | None
    finalize: FinalizeModel
    _tally: SurvivalTally = PrivateAttr(default_factory=SurvivalTally)

    def arguments(self) -> dict[str, Task]:
        return {"finalize": self.finalize}

    def execute(self, **_kwargs: Any) -> None:
        tally = self._tally
        if self.document is not None:
            document = with_survival(json.loads(self.document), tally)
            with open(
                os.path.join(self.out_path, STATISTICS_FILE), "w", encoding="utf-8"
            ) as handle:
                json.dump(strict_json(document), handle, indent=2, allow_nan=False)
        if tally.lost():
            LOG.warning(tally.warning())

    def main_thread_only(self) -> bool:
        return True


def scale_planned(planner: MergePlanner) -> tuple | None:
    """Run the statistics pass for a planned RAM+ merge and rewrite its tasks.

    Returns (settings, statistics, scales), or None when no pass is needed.
    """
    merges = [task for _, task in planner._tensors]
    if not merges:
        return None
    settings, explicit = planned_settings(merges)
    if not settings.needs_pass(explicit.keys(), explicit):
        return None
    run = getattr(planner, "_ram_run", None)
    stats, scales = count_planned(
        merges,
        settings,
        explicit,
        planner.options,
        inner_products=run is not None and run.inner_products,
    )
    planner._tensors = [
        (weight, with_scales(task, scales)) for weight, task in planner._tensors
    ]
    return settings, stats, scales


def with_scales(task: Any, scales: dict[Any, float]) -> Any:
    """A copy of a planned merge task whose task models carry their λ, its
    inputs marked as checked by the statistics pass that computed λ."""
    params = immutables.Map(
        {
            model: (
                immutables.Map({**values, "unique_scale": scales.get(model, 1.0)})
                if "unique_scale" in values
                else values
            )
            for model, values in task.input_parameters.items()
        }
    )
    scaled = task.model_copy(update={"input_parameters": params})
    scaled._checked = True
    return scaled


def rescales(merges: list[Any]) -> bool:
    """Whether some planned merge may scale unique elements by λ ≠ 1."""
    for task in merges:
        if task.parameters.get("r", 0) > 0:
            return True
        for params in task.input_parameters.values():
            if params.get("unique_scale") not in (None, 1.0):
                return True
    return False


def patched_plan(original):
    def _plan(self: MergePlanner) -> None:
        original(self)
        self._ram_run = None
        if is_ours(self.config.merge_method):
            # Outside run_merge (a planner used directly) the plan gets a run
            # of its own, held by its tasks only.
            run = current_run() or MergeRun()
            merges = [task for _, task in self._tensors]
            run.tally = SurvivalTally() if rescales(merges) else None
            self._ram_run = run
            self._tensors = [
                (w, as_ram_task(t, w.force_dtype or self.config.out_dtype, run))
                for w, t in self._tensors
            ]
            run.result = scale_planned(self)

    _plan.__mergekit_ram__ = original
    return _plan


def patched_plan_to_disk(original):
    def plan_to_disk(self: MergePlanner, out_path: str) -> list[Task]:
        tasks = original(self, out_path)
        run = getattr(self, "_ram_run", None)
        if run is None or (run.tally is None and run.result is None):
            return tasks
        finalize = next(t for t in tasks if isinstance(t, FinalizeModel))
        result = run.result
        document = None if result is None else json.dumps(statistics_document(*result))
        write = WriteStatistics(out_path=out_path, document=document, finalize=finalize)
        if run.tally is not None:
            write._tally = run.tally
        return tasks + [write]

    plan_to_disk.__mergekit_ram__ = original
    return plan_to_disk


def statistics_for_card() -> tuple | None:
    """(settings, statistics, scales, survival tally) of the merge in progress,
    for its model card; None when it computed no statistics."""
    run = current_run()
    if run is None or run.result is None:
        return None
    return (*run.result, run.tally)
