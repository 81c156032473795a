"""Whole-model statistics for RAM+: the pass, its read-ahead, the document.

The paper computes each agent's C, S and U over the whole model before any
tensor is merged. `MergePlanner._plan` is wrapped (`patched_plan`): once
mergekit has planned a `ram` / `ramplus` merge, every planned merge task
becomes a `methods.RAMMergeTask` of the merge in progress, and for global
RAM+ the statistics pass (`collect_planned`) streams over the planner's own
gather tasks, one group in memory at a time, walked in the reverse of the
merge's order with the next group's bytes read ahead (`read_ahead`); λ goes
to every planned task as its models' `unique_scale`. `plan_to_disk` gets a
last task that writes ram_statistics.json (`statistics_document`) once the
model is finalized, in the staging folder `publishing` publishes. The model
card's section on these statistics is `analysis.card`'s. `mergekit-ram
analyze` counts through `count_planned` too.

Every group is read through mergekit's own loading, as the merge reads it
(a MoE checkpoint's stored experts included, which mergekit's conversion
fuses as read: the pass pays that conversion as the merge does).

The mergekit and transformers names used here that mergekit does not
publish are in `host.CONTRACT`, probed before anything is installed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import immutables
import pydantic_core
import torch
from mergekit.graph import ExecutionSchedule, Executor, Task, TaskHandle
from mergekit.io.tasks import FinalizeModel, LoaderCache, LoadTensor
from mergekit.plan import MergePlanner
from pydantic import PrivateAttr

from mergekit_ram.core.checks import finite_inputs
from mergekit_ram.core.counting import OverlapStatistics, group_tensors
from mergekit_ram.core.rule import MergeSettings, SurvivalTally
from mergekit_ram.integration.checkpoints import safetensors_spans
from mergekit_ram.integration.context import Counted, MergeRun, current_run, merge_run
from mergekit_ram.integration.host import bound
from mergekit_ram.integration.methods import as_ram_task, is_ours
from mergekit_ram.integration.validation import check_plan, resolved_values

LOG = logging.getLogger("mergekit_ram")


# --- the statistics document ---------------------------


STATISTICS_FILE = "ram_statistics.json"


def statistics_document(
    settings: MergeSettings, stats: OverlapStatistics, scales: Mapping[Hashable, float]
) -> dict[str, Any]:
    """The content of ram_statistics.json; a task's rho is null when it has
    shared but no unique elements (ρ = ∞)."""
    return {
        **settings.as_dict(),
        "num_tensors": stats.num_tensors,
        "num_elements": stats.num_elements,
        "seconds": round(stats.seconds, 3),
        "tasks": [
            {
                "model": str(task),
                "elements": counts.elements,
                "changed": counts.changed,
                "shared": counts.shared,
                "unique": counts.unique,
                "overlap_histogram": list(counts.histogram),
                "rho": counts.rho if math.isfinite(counts.rho) else None,
                "scale": scales.get(task, 1.0),
            }
            for task, counts in stats.tasks.items()
        ],
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
        row["rescaled"], row["rescale_survived"] = counts.get(row["model"], missing)
    document["written_dtypes"] = None if tally is None else sorted(tally.dtypes)
    return document


def strict_json(value: Any) -> Any:
    """`value` as plain JSON data with every non-finite float as None, so
    json.dumps(..., allow_nan=False) writes standard JSON (`null`)."""
    return json.loads(pydantic_core.to_json(value, inf_nan_mode="null"))


# --- the pass ------------------------------------------------------------------

# (file, first byte, length) of one tensor's data.
Span = tuple[str, int, int]


def _count_task(
    stats: OverlapStatistics, task: Any, tensors: Mapping, device: torch.device
) -> None:
    """Check one planned merge task's gathered inputs, then count them."""
    name = task.output_weight.name
    group = group_tensors(
        tensors,
        task.base_model,
        task.model_order,
        device,
        name=name,
        vocabulary_axis=task.output_weight.vocabulary_axis,
    )
    if group is None:
        return
    base, inputs = group
    nonfinite = task.parameters.get("nonfinite", "refuse")
    if nonfinite != "refuse" or not inputs:
        kept = finite_inputs(name, task.base_model, base, inputs, nonfinite)
        stats.add(name, base, kept)
    # Refusing, the count's own sums of τ tell finite inputs apart; only a
    # group they doubt is checked element by element (and refused there).
    elif not stats.add(name, base, inputs):
        finite_inputs(name, task.base_model, base, inputs, nonfinite)


class BackwardExecutor(Executor):
    """mergekit's executor, its groups walked in the reverse of the merge's
    order: each target right after the tasks it needs that have not run yet
    (in their scheduled order). `forward` keeps the merge's order of targets;
    `ahead` holds, per group in the walk's order, where the tensors it loads
    lie on disk (safetensors shards only), for the read-ahead.

    mergekit schedules the pass's groups as it schedules the merge's (by
    tensor name). Where the inputs exceed memory, a pass in the merge's order
    ends with the merge's first inputs evicted from the page cache, and the
    merge reads every byte from disk again; walked backwards, the pass's last
    reads are the merge's first. Each value is still dropped after its last
    use, so about one group stays resident.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        position = {handle: index for index, handle in enumerate(self.schedule.tasks)}
        targets = sorted(self.targets, key=position.__getitem__)
        self.forward = [handle.task() for handle in targets]
        self.ahead: list[list[Span]] = []
        order: list[TaskHandle] = []
        placed: set[TaskHandle] = set()
        headers: dict[str, dict[str, tuple[int, int]]] = {}
        for target in reversed(targets):
            needed, pending = [], [target]
            while pending:
                handle = pending.pop()
                if handle not in placed:
                    placed.add(handle)
                    needed.append(handle)
                    pending.extend(handle.arguments().values())
            order += sorted(needed, key=position.__getitem__)
            self.ahead.append([s for h in needed if (s := _span(h.task(), headers))])
        last_use = {handle: index for index, handle in enumerate(order)}
        for index, handle in enumerate(order):
            for argument in handle.arguments().values():
                last_use[argument] = index
        self.schedule = ExecutionSchedule(tasks=order, last_use_index=last_use)


def collect_planned(
    planned: Sequence[Any],
    options: Any,
    *,
    epsilon: float,
    desc: str = "RAM+ statistics",
    inner_products: bool = False,
) -> OverlapStatistics:
    """Stream over the gathered inputs of planned merge tasks and count them,
    on the devices the merge under `options` uses.

    `planned` holds mergekit ExecuteMergeMethodTask objects. Their gather tasks
    (loads, tokenizer permutation, truncation, dtype) run in mergekit's own
    executor, one group at a time, and each group is dropped once counted.
    Every group is checked on the way (shapes, NaN/Inf under the task's
    `nonfinite` rule), so bad inputs fail here, before the merge writes
    anything. `inner_products`: also sum the task vectors' inner products
    (`mergekit-ram analyze`'s retention; costs a little more per group).
    """
    started = time.perf_counter()
    by_input: dict[Any, list[Any]] = {}
    for task in planned:
        by_input.setdefault(task.gather_tensors, []).append(task)
    stats = OverlapStatistics(epsilon=epsilon, inner_products=inner_products)
    math_device = torch.device(options.device or "cpu")
    executor = BackwardExecutor(
        targets=list(by_input),
        math_device=math_device,
        storage_device=math_device if options.low_cpu_memory else "cpu",
    )
    # The next group's bytes are read ahead, from a helper thread, while one
    # is counted.
    ahead = [*executor.ahead, []]
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="readahead") as worker:
        worker.submit(read_ahead, ahead[0])
        groups = executor.run(quiet=options.quiet, desc=desc)
        for (gather, tensors), upcoming in zip(groups, ahead[1:]):
            worker.submit(read_ahead, upcoming)
            for task in by_input[gather]:
                _count_task(stats, task, tensors, math_device)
            del tensors
    # Counted backwards, kept in the merge's order: the same statistics as a
    # forward pass, down to the order analyze's float sums run in.
    stats.in_order(
        task.output_weight.name
        for gather in executor.forward
        for task in by_input[gather]
    )
    # The pass's open shards keep every page it read mapped (and counted in
    # the process's resident memory) while the merge maps them again.
    LoaderCache().flush_all()
    stats.seconds = time.perf_counter() - started
    return stats


def count_planned(
    merges: list[Any],
    settings: MergeSettings,
    explicit: dict,
    options: Any,
    **kwargs: Any,
) -> tuple[OverlapStatistics, dict[Any, float]]:
    """Run the statistics engine over planned tasks (`collect_planned`'s
    keywords); λ per model, explicit first."""
    stats = collect_planned(merges, options, epsilon=settings.epsilon, **kwargs)
    return stats, stats.scales(settings.rule, explicit)


def _span(task: Task, headers: dict[str, dict[str, tuple[int, int]]]) -> Span | None:
    """Where the tensor a load reads (its own, an alias or a tied name) lies
    in its safetensors shard; None for any other task or file."""
    if not isinstance(task, LoadTensor):
        return None
    loader = LoaderCache().get(task.model)
    name = task._resolve_name(loader)
    path = name and os.path.join(
        loader.index.base_path, loader.index.tensor_paths[name]
    )
    if path and path.endswith(".safetensors") and path not in headers:
        try:
            headers[path] = safetensors_spans(path)
        # Not the safetensors it claims to be: no hint (validation refuses
        # truncated and corrupt files before a pass).
        except (OSError, ValueError, KeyError, TypeError):
            headers[path] = {}
    where = headers.get(path, {}).get(name)
    return None if where is None else (path, *where)


def read_ahead(spans: Sequence[Span]) -> None:
    """Ask the kernel to read these bytes into the page cache ahead of their
    use (posix_fadvise WILLNEED; best effort, nothing on Windows)."""
    for path, start, length in spans:
        try:
            with open(path, "rb") as file:
                os.posix_fadvise(file.fileno(), start, length, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            continue


# --- inside mergekit's planner --------------------------------------------------


class WriteStatistics(Task[None]):
    """After the weights are finalized: write ram_statistics.json (with λ's
    survival) and say in one line when the rescale was mostly lost. The
    merge it belongs to (`_run`, not part of its identity) holds what to
    write."""

    out_path: str
    finalize: FinalizeModel
    _run: MergeRun = PrivateAttr(default_factory=MergeRun)

    def arguments(self) -> dict[str, Task]:
        return {"finalize": self.finalize}

    def execute(self, **_kwargs: Any) -> None:
        run = self._run
        if run.result is not None:
            document = with_survival(statistics_document(*run.result), run.tally)
            path = os.path.join(self.out_path, STATISTICS_FILE)
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(strict_json(document), handle, indent=2, allow_nan=False)
        if run.tally is not None and run.tally.lost():
            LOG.warning(run.tally.warning())

    def main_thread_only(self) -> bool:
        return True


def with_scales(task: Any, scales: dict[Any, float]) -> Any:
    """A copy of a planned merge task whose task models carry their λ."""
    params = {
        model: immutables.Map({**values, "unique_scale": scales.get(model, 1.0)})
        if "unique_scale" in values
        else values
        for model, values in task.input_parameters.items()
    }
    return task.model_copy(update={"input_parameters": immutables.Map(params)})


class _Planned(Exception):
    """Stops mergekit's run_merge once it has planned (`plan_merges`); its
    one argument: the planned merge tasks."""


def _ours(planner: MergePlanner) -> bool:
    """Whether a planner plans a RAM merge (read with defaults: nothing of a
    stock merge's planner is required)."""
    return is_ours(getattr(getattr(planner, "config", None), "merge_method", None))


def patched_plan(original):
    def _plan(self: MergePlanner, *args: Any, **kwargs: Any) -> Any:
        planned = original(self, *args, **kwargs)
        if not _ours(self):
            return planned
        # Outside run_merge (a planner used directly) the plan gets a run of
        # its own, held by its tasks only.
        run = current_run() or MergeRun()
        merges = [task for _, task in self._tensors]
        if run.plan_only:
            raise _Planned(merges)
        if not merges:
            return planned
        # Every rule on the resolved parameters, once, before any weight is read.
        settings, explicit = check_plan(merges, run.findings)
        run.values = resolved_values(merges)
        # A tally when some unique element may be scaled by λ ≠ 1.
        scaled = any(v not in (None, 1.0) for v in explicit.values())
        run.tally = SurvivalTally() if scaled or max(run.values["r"]) > 0 else None
        rescale = settings.needs_pass(explicit.keys(), explicit)
        if rescale or run.inner_products:  # λ to apply, or a report asked
            counted = count_planned(
                merges,
                settings,
                explicit,
                self.options,
                inner_products=run.inner_products,
            )
            run.counted = Counted(settings, *counted)
        if rescale:
            run.result = run.counted
            self._tensors = [
                (w, with_scales(t, run.counted.scales)) for w, t in self._tensors
            ]
        out_dtype = self.config.out_dtype
        self._tensors = [
            (w, as_ram_task(t, w.force_dtype or out_dtype, run))
            for w, t in self._tensors
        ]
        return planned

    return _plan


def patched_plan_to_disk(original):
    def plan_to_disk(self: MergePlanner, *args: Any, **kwargs: Any) -> list[Task]:
        tasks = original(self, *args, **kwargs)
        if not _ours(self):
            return tasks
        # The merge a planned RAM merge belongs to, from its tasks: nothing
        # of ours is set on mergekit's planner.
        run = next((getattr(t, "_run", None) for _, t in self._tensors), None)
        if run is None or (run.tally is None and run.result is None):
            return tasks
        finalize = next(t for t in tasks if isinstance(t, FinalizeModel))
        out_path = bound(original, (self, *args), kwargs).arguments["out_path"]
        write = WriteStatistics(out_path=out_path, finalize=finalize)
        write._run = run
        return tasks + [write]

    return plan_to_disk


def plan_merges(config: Any, options: Any) -> list[Any]:
    """The merge tasks a merge of `config` would run (config is not modified),
    planned by mergekit's own run_merge, stopped before the RAM+ hook checks
    or counts anything. A configuration of another merge method is planned as
    `ramplus` with no global parameters: the same tensors, inputs and gather
    tasks, without that method's required parameters (weight, density, ...)
    or its own ones (DELLA's epsilon, ...) read as ours."""
    from mergekit import merge

    config = config.model_copy(deep=True)
    if not is_ours(config.merge_method):
        config.merge_method = "ramplus"
        config.parameters = None
    run_merge = getattr(merge.run_merge, "__mergekit_ram__", merge.run_merge)
    with merge_run() as run:
        run.plan_only = True
        try:
            run_merge(config, "", options)
        except _Planned as planned:
            return planned.args[0]
        finally:
            run.plan_only = False
    return []
