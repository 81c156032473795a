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
instead of a second pass).
"""

from __future__ import annotations

import json
import os
from typing import Any

import immutables
from mergekit.common import dtype_from_name
from mergekit.graph import Task
from mergekit.io.tasks import FinalizeModel
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from mergekit.plan import MergePlanner

from mergekit_ram.core.checks import check_layout, finite_output
from mergekit_ram.integration.context import current_run
from mergekit_ram.integration.methods import is_ours
from mergekit_ram.integration.results import (
    STATISTICS_FILE,
    statistics_document,
    strict_json,
)
from mergekit_ram.integration.statistics_pass import count_planned, planned_settings


class RAMMergeTask(ExecuteMergeMethodTask):
    """mergekit's merge task, with RAM's input rules before mergekit's checks.

    A non-float base tensor (an integer or bool buffer) is passed through as
    the base has it, even where a task model's differs (mergekit would
    refuse); mismatched shapes fail with a RAMInputError naming the models
    and, for a vocabulary axis, pointing to tokenizer_source.
    """

    # The dtype the planner writes this tensor in (mergekit casts when saving).
    written_dtype: str | None = None

    def execute(self, tensors: dict, **kwargs: Any) -> Any:
        base = tensors.get(self.base_model)
        if base is None:
            return super().execute(tensors, **kwargs)
        if not base.is_floating_point():
            return base
        weight = self.output_weight
        check_layout(weight.name, tensors, self.base_model, weight.vocabulary_axis)
        merged = super().execute(tensors, **kwargs)
        # The kernel checked its own result; mergekit casts it only when writing.
        out_dtype = dtype_from_name(self.written_dtype)
        if out_dtype is not None and out_dtype != merged.dtype:
            finite_output(weight.name, base, merged, out_dtype)
        return merged


def as_ram_task(task: ExecuteMergeMethodTask, out_dtype: str | None) -> RAMMergeTask:
    """The same planned merge as a RAMMergeTask, writing `out_dtype`."""
    fields = type(task).model_fields
    values = {name: getattr(task, name) for name in fields}
    return RAMMergeTask(**values, written_dtype=out_dtype)


class WriteStatistics(Task[None]):
    """Write ram_statistics.json after the weights are finalized."""

    out_path: str
    document: str
    finalize: FinalizeModel

    def arguments(self) -> dict[str, Task]:
        return {"finalize": self.finalize}

    def execute(self, **_kwargs: Any) -> None:
        with open(
            os.path.join(self.out_path, STATISTICS_FILE), "w", encoding="utf-8"
        ) as handle:
            handle.write(self.document)

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
    stats, scales = count_planned(merges, settings, explicit, planner.options)
    planner._tensors = [
        (weight, with_scales(task, scales)) for weight, task in planner._tensors
    ]
    return settings, stats, scales


def with_scales(task: Any, scales: dict[Any, float]) -> Any:
    """A copy of a planned merge task whose task models carry their λ."""
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
    return task.model_copy(update={"input_parameters": params})


def patched_plan(original):
    def _plan(self: MergePlanner) -> None:
        original(self)
        self._ram_result = None
        if is_ours(self.config.merge_method):
            self._tensors = [
                (w, as_ram_task(t, w.force_dtype or self.config.out_dtype))
                for w, t in self._tensors
            ]
            self._ram_result = scale_planned(self)
            run = current_run()
            if run is not None:
                run.result = self._ram_result

    _plan.__mergekit_ram__ = original
    return _plan


def patched_plan_to_disk(original):
    def plan_to_disk(self: MergePlanner, out_path: str) -> list[Task]:
        tasks = original(self, out_path)
        result = getattr(self, "_ram_result", None)
        if result is None:
            return tasks
        finalize = next(t for t in tasks if isinstance(t, FinalizeModel))
        document = json.dumps(
            strict_json(statistics_document(*result)), indent=2, allow_nan=False
        )
        return tasks + [
            WriteStatistics(out_path=out_path, document=document, finalize=finalize)
        ]

    plan_to_disk.__mergekit_ram__ = original
    return plan_to_disk


def statistics_for_card() -> tuple | None:
    """The statistics the merge in progress computed, for its model card."""
    run = current_run()
    return None if run is None else run.result
