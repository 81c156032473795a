"""The statistics pass over a planned mergekit merge (global RAM+ λ).

`collect_planned` streams over the groups a planned merge will compute, so
the global RAM+ scale sees exactly what the merge sees while only about one
tensor group is resident at a time. It walks them in the reverse of the
merge's order (`reversed_groups`), so the pass ends on the inputs the merge
starts with. The planner hook and `mergekit-ram analyze` both count through
`count_planned`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from mergekit.graph import ExecutionSchedule, Executor, TaskHandle
from mergekit.io.tasks import LoaderCache

from mergekit_ram.core.checks import finite_inputs
from mergekit_ram.core.counting import OverlapStatistics, group_tensors
from mergekit_ram.core.settings import MergeSettings, unique_scale_error
from mergekit_ram.integration.prefetch import ReadAhead, hinted, loads_per_group


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
    executor = Executor(
        targets=list(by_input),
        math_device=math_device,
        storage_device=torch.device(storage_device or "cpu"),
    )
    targets = set(executor.targets)
    forward = [h.task() for h in executor.schedule.tasks if h in targets]
    executor.schedule = reversed_groups(executor.schedule, executor.targets)
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
        task.output_weight.name for gather in forward for task in by_input[gather]
    )
    # The pass's open shards keep every page it read mapped (and counted in
    # the process's resident memory) while the merge maps them again.
    LoaderCache().flush_all()
    stats.seconds = time.perf_counter() - started
    return stats


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
