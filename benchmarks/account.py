"""Where every second of one `mergekit-yaml` merge goes: a table of stages.

Runs the real `mergekit-yaml CONFIG OUT [OPTIONS]` in a child process whose
functions of interest (mergekit's and ours) are wrapped with timers by this
script, not by the package: the package carries no timing code, so nothing
costs anything when this script is not used. Each stage's time is exclusive
(a stage called inside another is not counted twice) and measured on the main
thread, where mergekit's executor runs every task; what no stage claims is
the last row, and the whole process's wall (interpreter start and exit
included) is measured from outside.

    python benchmarks/account.py CONFIG OUT [mergekit-yaml options]
    python benchmarks/speed.py ... --account    # the same, per method, in its table

Stages of the statistics pass and of the merge are told apart by whether
`integration.statistics.collect_planned` is running.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

# (row, what it holds), in the table's order.
ROWS = (
    ("imports: torch, safetensors", "their imports alone"),
    ("imports: mergekit", "mergekit-yaml's modules (transformers, pydantic, ...)"),
    ("imports: mergekit-ram", "our package and its install into mergekit"),
    ("mergekit: loader cache", "opening every model's index and shards"),
    ("mergekit: planning", "MergePlanner (without our hook's parts below)"),
    ("ours: checks", "configuration, checkpoint headers, the plan's rules"),
    ("pass: read", "the statistics pass's tensor loads"),
    ("pass: count", "the statistics pass's counts and checks"),
    ("pass: rest", "the pass's executor, gathers and bookkeeping"),
    ("merge: read", "the merge's tensor loads"),
    ("merge: kernel", "merge tasks (mergekit's adapter and our kernel)"),
    ("merge: write", "SaveTensor and FinalizeModel (safetensors writes)"),
    ("ours: statistics file, card", "ram_statistics.json and the model card"),
    ("ours: publishing", "lock, staging, moving the files into OUT"),
    ("mergekit: rest of run_merge", "its executor loop, config and tokenizer copies"),
    ("python: start, exit, CLI", "interpreter start-up and exit, click, the rest"),
)


class Timers:
    """Exclusive seconds per row, main thread only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []  # [row, seconds of callees]
        self.in_pass = False

    def timed(self, row: str | Callable[[], str], function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                return function(*args, **kwargs)
            self.stack.append([row() if callable(row) else row, 0.0])
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                name, inner = self.stack.pop()
                self.seconds[name] += elapsed - inner
                if self.stack:
                    self.stack[-1][1] += elapsed

        return wrapper

    def wrap(self, owner: Any, name: str, row: str | Callable[[], str]) -> None:
        setattr(owner, name, self.timed(row, getattr(owner, name)))


def phase(stage: str) -> Callable[[], str]:
    return lambda: f"{'pass' if TIMERS.in_pass else 'merge'}: {stage}"


TIMERS = Timers()


def child(arguments: list[str], result: str) -> None:
    """The timed merge; writes {row: seconds} to `result`."""
    started = time.perf_counter()

    def torch_imports() -> None:
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401

    def mergekit_imports() -> Any:
        from mergekit.scripts import run_yaml

        return run_yaml

    TIMERS.timed("imports: torch, safetensors", torch_imports)()
    import _mergekit_ram_autoload as autoload

    # Our install runs as mergekit's watched modules finish importing.
    autoload._loaded = TIMERS.timed("imports: mergekit-ram", autoload._loaded)
    run_yaml = TIMERS.timed("imports: mergekit", mergekit_imports)()
    _install_timers()
    try:
        run_yaml.main(arguments, standalone_mode=False)
    finally:
        TIMERS.seconds["total (in process)"] = time.perf_counter() - started
        with open(result, "w") as handle:
            json.dump(TIMERS.seconds, handle)


def _install_timers() -> None:
    from mergekit import merge
    from mergekit.io import tasks
    from mergekit.io.tasks import LoaderCache
    from mergekit.merge_methods.task_adapter import ExecuteMergeMethodTask
    from mergekit.plan import MergePlanner

    from mergekit_ram.integration import methods, output_folder, publishing, statistics

    wrap = TIMERS.wrap
    # Our run_merge holds mergekit's in its closure (install's one change).
    guarded = merge.run_merge
    for cell in guarded.__closure__ or ():
        if cell.cell_contents is guarded.__mergekit_ram__:
            cell.cell_contents = TIMERS.timed(
                "mergekit: rest of run_merge", cell.cell_contents
            )
    from mergekit.scripts import run_yaml

    wrap(run_yaml, "run_merge", "ours: publishing")
    wrap(publishing, "staged_merge", "ours: publishing")
    wrap(output_folder, "_publish", "ours: publishing")
    wrap(LoaderCache, "get", "mergekit: loader cache")
    wrap(MergePlanner, "plan_to_disk", "mergekit: planning")
    wrap(MergePlanner, "_plan", "mergekit: planning")
    for module, name in (
        (publishing, "check_config"),
        (publishing, "refuse_input_folder"),
        (statistics, "check_plan"),
    ):
        wrap(module, name, "ours: checks")

    def entering(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            TIMERS.in_pass = True
            try:
                return function(*args, **kwargs)
            finally:
                TIMERS.in_pass = False

        return wrapper

    statistics.collect_planned = entering(
        TIMERS.timed("pass: rest", statistics.collect_planned)
    )
    wrap(statistics, "_count_task", "pass: count")
    wrap(tasks.LoadTensor, "execute", phase("read"))
    wrap(methods.RAMMergeTask, "execute", "merge: kernel")
    wrap(ExecuteMergeMethodTask, "execute", "merge: kernel")  # stock methods
    wrap(tasks.SaveTensor, "execute", "merge: write")
    wrap(tasks.FinalizeModel, "execute", "merge: write")
    wrap(statistics.WriteStatistics, "execute", "ours: statistics file, card")
    wrap(merge, "generate_card", "ours: statistics file, card")


def account(arguments: Sequence[str]) -> dict[str, float]:
    """Seconds per row of one merge, run in a child process; the whole
    process's wall is 'wall'."""
    with tempfile.TemporaryDirectory(prefix="account-") as folder:
        result = os.path.join(folder, "seconds.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", result]
        start = time.perf_counter()
        subprocess.run([*command, *arguments], check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        with open(result) as handle:
            seconds = json.load(handle)
    seconds.pop("total (in process)")
    seconds["python: start, exit, CLI"] = wall - sum(seconds.values())
    seconds["wall"] = wall
    return seconds


def table(columns: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown: median seconds per row, one column per label."""
    import statistics

    labels = list(columns)
    lines = [
        "| stage | " + " | ".join(f"{label} s" for label in labels) + " | what |",
        "|---|" + "---|" * len(labels) + "---|",
    ]
    for row, what in (*ROWS, ("wall", "the whole process, measured outside it")):
        cells = [
            f"{statistics.median(run.get(row, 0.0) for run in runs):.2f}"
            for runs in columns.values()
        ]
        if row == "wall":
            cells = [f"**{cell}**" for cell in cells]
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {what} |")
    return lines


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--child"]:
        child(list(argv[2:]), argv[1])
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(table({"merge": [account(argv)]})))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
