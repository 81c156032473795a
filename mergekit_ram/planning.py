"""Global RAM+ inside mergekit's planner: count, then hand λ to every merge task.

`MergePlanner._plan` is wrapped so that, once mergekit has planned a `ram` or
`ramplus` merge, the statistics pass runs over the planner's own gather tasks
and each planned merge task gets the resulting λ as its models'
`unique_scale`. Every entry point (mergekit-yaml, mergekit-ram merge, the
Python run_merge) plans through this class, so all of them compute the same
numbers. Each planned merge task becomes a `RAMMergeTask`, which applies
RAM's input rules before mergekit's own checks. `plan_to_disk` additionally
gets a last task that writes ram_statistics.json once the model has been
finalized (into the staging folder of `mergekit_ram.output`, published only
when the whole merge succeeded), and hands the result to a caller that asked
for it with `capture_result` (`mergekit-ram merge --report` reuses the
merge's statistics that way instead of a second pass).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import immutables
from mergekit.common import dtype_from_name
from mergekit.graph import Task
from mergekit.io.tasks import FinalizeModel
from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
from mergekit.plan import MergePlanner

from mergekit_ram.inputs import check_layout, finite_output
from mergekit_ram.method import is_ours
from mergekit_ram.publishing import destination
from mergekit_ram.report import STATISTICS_FILE, statistics_document, strict_json
from mergekit_ram.settings import MergeSettings, unique_scale_error
from mergekit_ram.statistics import collect_planned

# Statistics of finished plans, for the model card (keyed by config identity).
PENDING_CARDS: dict[int, tuple] = {}

# Plans someone is waiting for (capture_result), keyed by absolute out_path.
_CAPTURED: dict[str, list] = {}


@contextmanager
def capture_result(out_path: str) -> Iterator[list]:
    """Collect what merges planned to `out_path` computed, while in the block.

    The yielded list gets one entry per `plan_to_disk(out_path)`: the planner's
    (settings, statistics, scales), or None when the merge needed no statistics
    pass (RAM with r = 0, tensor scope, explicit unique_scale, other methods).
    Nothing is kept for merges nobody asked about.
    """
    key = os.path.abspath(out_path)
    slot: list = []
    _CAPTURED[key] = slot
    try:
        yield slot
    finally:
        if _CAPTURED.get(key) is slot:
            del _CAPTURED[key]


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


def explicit_scales(merges: list[Any], base: Any) -> dict[Any, float | None]:
    """Each task model's `unique_scale`, which must be one value per model."""
    found: dict[Any, tuple] = {}
    for task in merges:
        for model, params in task.input_parameters.items():
            if model == base:
                continue
            value = params.get("unique_scale")
            seen = found.setdefault(model, (value, task.output_weight.name))
            if seen[0] != value:
                raise unique_scale_error(
                    model,
                    f"is {seen[0]!r} for tensor {seen[1]} but {value!r} for "
                    f"{task.output_weight.name}",
                )
    return {model: value for model, (value, _) in found.items()}


def planned_settings(merges: list[Any]) -> tuple[MergeSettings, dict[Any, Any]]:
    """The merge's scalar settings and each task model's explicit unique_scale."""
    settings = MergeSettings.from_parameters(
        (task.output_weight.name, task.parameters) for task in merges
    )
    return settings, explicit_scales(merges, merges[0].base_model)


def count_planned(
    merges: list[Any],
    settings: MergeSettings,
    explicit: dict[Any, Any],
    options: Any,
    desc: str = "RAM+ statistics",
) -> tuple[Any, dict[Any, float]]:
    """Run the statistics engine over planned tasks; λ per model, explicit first."""
    stats = collect_planned(
        merges,
        epsilon=settings.epsilon,
        device=options.device,
        storage_device=options.device if options.low_cpu_memory else "cpu",
        quiet=options.quiet,
        desc=desc,
    )
    return stats, stats.scales(settings.rule, explicit)


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
            if self._ram_result is not None and self.options.write_model_card:
                PENDING_CARDS[id(self.config)] = (self.config, self._ram_result)

    _plan.__mergekit_ram__ = original
    return _plan


def patched_plan_to_disk(original):
    def plan_to_disk(self: MergePlanner, out_path: str) -> list[Task]:
        tasks = original(self, out_path)
        result = getattr(self, "_ram_result", None)
        slot = _CAPTURED.get(destination(out_path))
        if slot is not None:
            slot.append(result)
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


def statistics_for_card(config: Any) -> tuple | None:
    """Pop the statistics a finished plan left for this configuration's card."""
    entry = PENDING_CARDS.pop(id(config), None)
    if entry is None or entry[0] is not config:
        return None
    return entry[1]
