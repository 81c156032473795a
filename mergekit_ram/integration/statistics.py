"""Whole-model statistics for RAM+: the pass, its read-ahead, the document.

The paper computes each agent's C, S and U over the whole model before any
tensor is merged. `MergePlanner._plan` is wrapped (`patched_plan`): once
mergekit has planned a `ram` / `ramplus` merge, every planned merge task
becomes a `methods.RAMMergeTask` of the merge in progress, and for global
RAM+ the statistics pass (`collect_planned`) streams over the planner's own
gather tasks, one group in memory at a time, walked in the reverse of the
merge's order with the next group's bytes read ahead (`ReadAhead`); λ goes
to every planned task as its models' `unique_scale`. `plan_to_disk` gets a
last task that writes ram_statistics.json (`statistics_document`) once the
model is finalized, in the staging folder `publishing` publishes. The model
card's section on these statistics is `analysis.card`'s. `mergekit-ram
analyze` counts through `count_planned` too.

mergekit names read here that it does not publish: `MergePlanner._tensors`
(the planned tasks), `LoadTensor._resolve_name` (which tensor a load reads).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import immutables
import torch
from mergekit.graph import ExecutionSchedule, Executor, Task, TaskHandle
from mergekit.io.tasks import FinalizeModel, LoaderCache, LoadTensor
from mergekit.plan import MergePlanner
from pydantic import PrivateAttr

from mergekit_ram.core.checks import finite_inputs
from mergekit_ram.core.counting import (
    OverlapStatistics,
    group_tensors,
)
from mergekit_ram.core.rule import MergeSettings, SurvivalTally
from mergekit_ram.integration.checkpoints import safetensors_spans
from mergekit_ram.integration.context import MergeRun, current_run
from mergekit_ram.integration.methods import as_ram_task, is_ours
from mergekit_ram.integration.validation import check_plan, resolved_values

LOG = logging.getLogger("mergekit_ram")


# --- the statistics document ---------------------------


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


# --- the pass ------------------------------------------------------------------


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
        stats.add(
            name, base, finite_inputs(name, task.base_model, base, inputs, nonfinite)
        )
    # Refusing, the count's own sums of τ tell finite inputs apart; only a
    # group they doubt is checked element by element (and refused there).
    elif not stats.add(name, base, inputs):
        finite_inputs(name, task.base_model, base, inputs, nonfinite)


def reversed_groups(
    schedule: ExecutionSchedule, targets: Sequence[TaskHandle]
) -> ExecutionSchedule:
    """`schedule` with its targets in reverse order, each right after the
    tasks it needs that have not run yet (in their scheduled order).

    mergekit schedules the pass's groups as it schedules the merge's (by
    tensor name). Where the inputs exceed memory, a pass in the merge's order
    ends with the merge's first inputs evicted from the page cache, and the
    merge reads every byte from disk again; walked backwards, the pass's last
    reads are the merge's first. Each value is still dropped after its last
    use, so about one group stays resident.
    """
    position = {handle: index for index, handle in enumerate(schedule.tasks)}
    order: list[TaskHandle] = []
    placed: set[TaskHandle] = set()
    for target in sorted(targets, key=position.__getitem__, reverse=True):
        needed: list[TaskHandle] = []
        pending = [target]
        while pending:
            handle = pending.pop()
            if handle not in placed:
                placed.add(handle)
                needed.append(handle)
                pending.extend(handle.arguments().values())
        order += sorted(needed, key=position.__getitem__)
    last_use = {handle: index for index, handle in enumerate(order)}
    for index, handle in enumerate(order):
        for argument in handle.arguments().values():
            last_use[argument] = index
    return ExecutionSchedule(tasks=order, last_use_index=last_use)


class BackwardExecutor(Executor):
    """mergekit's executor, its groups walked in the reverse of the merge's
    order (`reversed_groups`); `forward` keeps the merge's order of targets."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        targets = set(self.targets)
        self.forward = [h.task() for h in self.schedule.tasks if h in targets]
        self.schedule = reversed_groups(self.schedule, self.targets)


def collect_planned(
    planned: Sequence[Any],
    *,
    epsilon: float,
    device: str | None,
    storage_device: str | None,
    quiet: bool,
    desc: str = "RAM+ statistics",
    inner_products: bool = False,
) -> OverlapStatistics:
    """Stream over the gathered inputs of planned merge tasks and count them.

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
    math_device = torch.device(device or "cpu")
    executor = BackwardExecutor(
        targets=list(by_input),
        math_device=math_device,
        storage_device=torch.device(storage_device or "cpu"),
    )
    targets = set(executor.targets)
    upcoming = loads_per_group(executor.schedule, targets)
    read_ahead = ReadAhead()
    try:
        groups = executor.run(quiet=quiet, desc=desc)
        for gather, tensors in hinted(groups, upcoming, read_ahead):
            for task in by_input[gather]:
                _count_task(stats, task, tensors, math_device)
            del tensors
    finally:
        read_ahead.close()
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
    explicit: dict[Any, Any],
    options: Any,
    desc: str = "RAM+ statistics",
    inner_products: bool = False,
) -> tuple[OverlapStatistics, dict[Any, float]]:
    """Run the statistics engine over planned tasks; λ per model, explicit first."""
    stats = collect_planned(
        merges,
        epsilon=settings.epsilon,
        device=options.device,
        storage_device=options.device if options.low_cpu_memory else "cpu",
        quiet=options.quiet,
        desc=desc,
        inner_products=inner_products,
    )
    return stats, stats.scales(settings.rule, explicit)


# --- reading ahead ------------------------------------------------------------


# (file, first byte, length) of one tensor's data.
Span = tuple[str, int, int]
# What a file that is not the safetensors it claims to be raises here; it
# gets no hint (validation refuses truncated and corrupt files before a pass).
UNREADABLE = (OSError, ValueError, KeyError, TypeError)


def loads_per_group(
    schedule: ExecutionSchedule, targets: Collection[TaskHandle]
) -> list[list[LoadTensor]]:
    """The LoadTensor tasks each target's group runs, in the schedule's order.

    The statistics pass schedules each target right after the tasks it needs
    that have not run yet, so a group's loads are those since the previous
    target."""
    groups: list[list[LoadTensor]] = []
    current: list[LoadTensor] = []
    for handle in schedule.tasks:
        task = handle.task()
        if isinstance(task, LoadTensor):
            current.append(task)
        if handle in targets:
            groups.append(current)
            current = []
    return groups


class ReadAhead:
    """Hints the kernel to read groups' input bytes ahead of their use."""

    def __init__(self) -> None:
        self._spans: dict[str, dict[str, tuple[int, int]]] = {}
        self._files: dict[str, int] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="readahead")

    def spans(self, loads: Iterable[LoadTensor]) -> list[Span]:
        """Where each load's tensor lies on disk (safetensors shards only)."""
        spans = []
        for load in loads:
            loader = LoaderCache().get(load.model)
            # The name the load itself will read (its own, an alias or a tied name).
            name = load._resolve_name(loader)
            if name is None:
                continue
            index = loader.index
            path = os.path.join(index.base_path, index.tensor_paths[name])
            if not path.endswith(".safetensors"):
                continue
            if path not in self._spans:
                self._spans[path] = safetensors_spans(path)
            where = self._spans[path].get(name)
            if where is not None:
                spans.append((path, *where))
        return spans

    def hint(self, loads: Sequence[LoadTensor]) -> None:
        """Start reading these tensors' bytes in the background (best effort)."""
        if not hasattr(os, "posix_fadvise") or not loads:
            return
        try:
            spans = self.spans(loads)
        except UNREADABLE:
            return
        self._worker.submit(self._advise, spans)

    def _advise(self, spans: list[Span]) -> None:
        for path, start, length in spans:
            try:
                if path not in self._files:
                    self._files[path] = os.open(path, os.O_RDONLY)
                os.posix_fadvise(
                    self._files[path], start, length, os.POSIX_FADV_WILLNEED
                )
            except OSError:
                continue

    def close(self) -> None:
        """Wait for pending hints, then close the files they opened."""
        self._worker.shutdown(wait=True)
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()


def hinted(
    pairs: Iterable[tuple[Any, Any]],
    upcoming: Sequence[Sequence[LoadTensor]],
    read_ahead: ReadAhead,
) -> Iterator[tuple[Any, Any]]:
    """Yield `pairs` (one per group, in `upcoming`'s order), hinting the next
    group's loads as each group is handed out."""
    if upcoming:
        read_ahead.hint(upcoming[0])
    for index, pair in enumerate(pairs):
        if index + 1 < len(upcoming):
            read_ahead.hint(upcoming[index + 1])
        yield pair


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


def scale_planned(
    planner: MergePlanner,
    run: MergeRun,
    settings: MergeSettings,
    explicit: dict[Any, Any],
) -> tuple | None:
    """Run the statistics pass for a planned RAM+ merge and rewrite its tasks.

    Returns (settings, statistics, scales), or None when no pass is needed.
    """
    if not settings.needs_pass(explicit.keys(), explicit):
        return None
    merges = [task for _, task in planner._tensors]
    stats, scales = count_planned(
        merges,
        settings,
        explicit,
        planner.options,
        inner_products=run.inner_products,
    )
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


def rescales(merges: list[Any]) -> bool:
    """Whether some planned merge may scale unique elements by λ ≠ 1."""
    for task in merges:
        if task.parameters.get("r", 0) > 0:
            return True
        for params in task.input_parameters.values():
            if params.get("unique_scale") not in (None, 1.0):
                return True
    return False


def planned_run(planner: MergePlanner) -> MergeRun | None:
    """The merge a planned RAM merge belongs to (None: not ours), from its
    tasks: nothing of ours is set on mergekit's planner."""
    task = next((task for _, task in planner._tensors), None)
    return getattr(task, "_run", None)


def patched_plan(original):
    def _plan(self: MergePlanner) -> None:
        original(self)
        if is_ours(self.config.merge_method):
            # Outside run_merge (a planner used directly) the plan gets a run
            # of its own, held by its tasks only.
            run = current_run() or MergeRun()
            merges = [task for _, task in self._tensors]
            if not merges:
                return
            # Every rule on the resolved parameters, once, before any weight is read.
            settings, explicit = check_plan(merges, run.findings)
            run.values = resolved_values(merges)
            run.tally = SurvivalTally() if rescales(merges) else None
            self._tensors = [
                (w, as_ram_task(t, w.force_dtype or self.config.out_dtype, run))
                for w, t in self._tensors
            ]
            run.result = scale_planned(self, run, settings, explicit)

    _plan.__mergekit_ram__ = original
    return _plan


def patched_plan_to_disk(original):
    def plan_to_disk(self: MergePlanner, out_path: str) -> list[Task]:
        tasks = original(self, out_path)
        run = planned_run(self)
        if run is None or (run.tally is None and run.result is None):
            return tasks
        finalize = next(t for t in tasks if isinstance(t, FinalizeModel))
        write = WriteStatistics(out_path=out_path, finalize=finalize)
        write._run = run
        return tasks + [write]

    plan_to_disk.__mergekit_ram__ = original
    return plan_to_disk


def plan_merges(config: Any, options: Any) -> list[Any]:
    """The merge tasks a merge of `config` would run (config is not modified).

    As mergekit.merge.run_merge plans, but through the planner's original
    `_plan`, so the RAM+ hook does not run its own statistics pass. A
    configuration of another merge method is planned as `ramplus` with no
    global parameters: the same tensors, inputs and gather tasks.
    """
    from mergekit import merge as mergekit_merge
    from mergekit.architecture import get_architecture_info
    from tqdm import tqdm

    config = config.model_copy(deep=True)
    if not is_ours(config.merge_method):
        # Only the models and the base matter: plan as RAM+ so that another
        # method's required parameters (weight, density, ...) are not needed
        # and its own parameters (DELLA's epsilon, ...) are not read as ours.
        config.merge_method = "ramplus"
        config.parameters = None
    if not config.models and not config.slices and not config.modules:
        raise ValueError("the configuration has no models")
    arch_info = get_architecture_info(config, options)
    loader_cache = LoaderCache()
    loader_cache.setup(options=options)
    out_config = mergekit_merge._model_out_config(
        config, arch_info, trust_remote_code=options.trust_remote_code
    )
    for model in tqdm(
        config.referenced_models(), desc="Warmup loader cache", disable=options.quiet
    ):
        loader_cache.get(model)
    planner = MergePlanner(
        config, arch_info, options=options, out_model_config=out_config
    )
    plan = getattr(MergePlanner._plan, "__mergekit_ram__", MergePlanner._plan)
    plan(planner)
    return [task for _, task in planner._tensors]
