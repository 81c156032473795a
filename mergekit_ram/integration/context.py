"""What one merge computed, carried from the planner to the card and the caller.

The run_merge wrapper opens a `MergeRun` for the duration of one RAM merge
(a context variable, so nothing outlives the merge, failed or not); the
planner hook stores what the statistics pass counted there (`Counted`), and
the model-card hook and `mergekit-ram merge --report` read it back. The
survival tally of λ (`core.rule`) lives there too: the planner makes it,
each merge task adds to it, the last task writes it out. Merge tasks may run
on worker threads (mergekit's --multi-gpu executor), which do not inherit
the context; they carry their run and bind it with `running`. The run's
worker threads (`core.parallel`) serve every chunked walk of the merge, the
pass's included, and end with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mergekit_ram.core.counting import LocalScales, OverlapStatistics
from mergekit_ram.core.parallel import Workers, binding, using, workers
from mergekit_ram.core.rule import MergeSettings, SurvivalTally


class Counted(NamedTuple):
    """What the statistics pass of a global RAM+ merge computed: its settings,
    the counts, and each task model's λ."""

    settings: MergeSettings
    stats: OverlapStatistics
    scales: dict[Any, float]


@dataclass(eq=False)
class MergeRun:
    """One merge in progress; `result` is None until (and unless) RAM+ counted
    to rescale, `tally` None unless some task model's unique elements are
    rescaled; `inner_products`: the caller (`merge --report`) wants the
    statistics, with the task vectors' inner products for the report's
    retention, counted even where the merge needs no pass; `counted`: what
    the pass counted (the merge's `result`, or the report's);
    `workers`: the threads its chunked walks share (None outside `merge_run`);
    `local`: what tensor-local RAM+ computed, for the card; `findings`: the
    configuration's warnings, for the plan-time checks to report with theirs
    (validation); `values`: each setting's values over the planned tensors,
    for the card; `card_name`: the name mergekit would give the card (OUT's
    last name), since mergekit writes into our staging folder; `plan_only`:
    stop mergekit's run_merge once it has planned (`statistics.plan_merges`).

    Compared by identity: merge tasks carry their run, and mergekit compares
    tasks (their statistics must never be compared element by element).
    """

    result: Counted | None = None
    counted: Counted | None = None
    tally: SurvivalTally | None = None
    inner_products: bool = False
    workers: Workers | None = None
    local: LocalScales = field(default_factory=LocalScales)
    findings: Any = None
    values: dict = field(default_factory=dict)
    card_name: str | None = None
    plan_only: bool = False


_CURRENT: ContextVar[MergeRun | None] = ContextVar("mergekit_ram_run", default=None)


def current_run() -> MergeRun | None:
    """The merge in progress in this context, if a RAM merge is running."""
    return _CURRENT.get()


@contextmanager
def merge_run() -> Iterator[MergeRun]:
    """The merge in progress, opened here unless the caller already opened one."""
    if (run := _CURRENT.get()) is not None:
        yield run
        return
    with workers() as pool, running(run := MergeRun(workers=pool)):
        yield run


@contextmanager
def running(run: MergeRun | None) -> Iterator[None]:
    """`run` as the merge in progress for the block (on this thread, too),
    with its worker threads."""
    with binding(_CURRENT, run) as bound, using(run.workers if bound else None):
        yield
