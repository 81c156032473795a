"""Where every second of one `mergekit-yaml` merge goes: a table of stages.

Runs the real `mergekit-yaml CONFIG OUT [OPTIONS]` in a child process whose
functions of interest (mergekit's and ours) are wrapped with timers by this
script, not by the package: the package carries no timing code, so nothing
costs anything when this script is not used. Each stage's time is exclusive
(a stage called inside another is not counted twice) and measured on the main
thread, where mergekit's executor runs every task; what no stage claims is
the last row, and the whole process's wall (interpreter start and exit
included) is measured from outside.

    python benchmarks/account.py OUT ram.yml ramplus.yml --rounds 3 \\
        --compare before=/path/to/older/checkout --options "--no-copy-tokenizer"

Stages of the statistics pass and of the merge are told apart by whether
`integration.statistics.collect_planned` is running.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import statistics
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
    ("mergekit: CLI, the rest", "click, reading the YAML, what no row claims"),
    ("python: start and exit", "interpreter start-up and exit (modules torn down)"),
)


class Timers:
    """Exclusive seconds per row, main thread only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []  # [row, seconds of callees]

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
    """The row of `stage` in the statistics pass (inside collect_planned's
    row) or in the merge."""
    return lambda: (
        f"pass: {stage}"
        if any(row == "pass: rest" for row, _ in TIMERS.stack)
        else f"merge: {stage}"
    )


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
    ours = getattr(guarded, "__mergekit_ram__", None)  # None: autoload off
    for cell in guarded.__closure__ or ():
        if cell.cell_contents is ours:
            cell.cell_contents = TIMERS.timed(
                "mergekit: rest of run_merge", cell.cell_contents
            )
    from mergekit.scripts import run_yaml

    wrap(
        run_yaml,
        "run_merge",
        "ours: publishing" if ours else "mergekit: rest of run_merge",
    )
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

    wrap(statistics, "collect_planned", "pass: rest")
    wrap(statistics, "_count_task", "pass: count")
    wrap(tasks.LoadTensor, "execute", phase("read"))
    wrap(methods.RAMMergeTask, "execute", "merge: kernel")
    wrap(ExecuteMergeMethodTask, "execute", "merge: kernel")  # stock methods
    wrap(tasks.SaveTensor, "execute", "merge: write")
    wrap(tasks.FinalizeModel, "execute", "merge: write")
    wrap(statistics.WriteStatistics, "execute", "ours: statistics file, card")
    wrap(merge, "generate_card", "ours: statistics file, card")


def account(
    config: str, out: str, options: Sequence[str], tree: str | None = None
) -> dict[str, float]:
    """Seconds per row of one merge, run in a child process (`tree`: a
    checkout whose mergekit_ram is imported instead); 'wall' is the whole
    process's, measured from outside."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(tree), *filter(None, [env.get("PYTHONPATH")])]
        )
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="account-") as folder:
        result = os.path.join(folder, "seconds.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", result]
        start = time.perf_counter()
        subprocess.run(
            [*command, config, out, "--quiet", *options],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        with open(result) as handle:
            seconds = json.load(handle)
    shutil.rmtree(out, ignore_errors=True)
    total = seconds.pop("total (in process)")
    seconds["mergekit: CLI, the rest"] = total - sum(seconds.values())
    seconds["python: start and exit"] = wall - total
    return {**{row: seconds.get(row, 0.0) for row, _ in ROWS}, "wall": wall}


def table(columns: dict[str, list[dict[str, float]]]) -> list[str]:
    """Markdown: median seconds per row, one column per label."""
    lines = [
        "| stage | " + " | ".join(f"{label} s" for label in columns) + " | what |",
        "|---|" + "---|" * len(columns) + "---|",
    ]
    for row, what in (*ROWS, ("wall", "the whole process, measured outside it")):
        cells = [
            f"{statistics.median(run[row] for run in runs):.2f}"
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the output folder (removed after each run)")
    parser.add_argument("configs", nargs="+", help="one column per configuration")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also run each configuration with another checkout's mergekit_ram",
    )
    parser.add_argument(
        "--options", default="", help="more mergekit-yaml options, one string"
    )
    args = parser.parse_args(argv)
    trees = {"": None, **dict(entry.split("=", 1) for entry in args.compare)}
    columns: dict[str, list[dict[str, float]]] = {
        f"{os.path.splitext(os.path.basename(c))[0]}{f' [{t}]' if t else ''}": []
        for c in args.configs
        for t in trees
    }
    for _ in range(args.rounds):  # interleaved
        for config in args.configs:
            for label, tree in trees.items():
                name = os.path.splitext(os.path.basename(config))[0]
                run = account(config, args.out, shlex.split(args.options), tree)
                columns[f"{name}{f' [{label}]' if label else ''}"].append(run)
                print(f"{name} [{label}] {run['wall']:.1f} s", file=sys.stderr)
    print(
        f"`python benchmarks/account.py {shlex.join(argv)}`, medians of {args.rounds}"
    )
    print("\n".join(table(columns)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
