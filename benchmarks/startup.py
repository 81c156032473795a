"""How fast the commands answer: --version, --help, and a tiny merge's start-up.

Whole processes, timed from outside (time.perf_counter around each run),
the cases taking turns round by round; medians are printed. `merge --help`
imports mergekit's options, as `mergekit-yaml --help` does. The last two rows
merge the same tiny models (the demo's base and three agents, in a temporary
folder) with `mergekit-ram merge` and stock `mergekit-yaml`: the merge itself
takes little, so the time is mostly start-up; the ratio is taken round by round.

    python benchmarks/startup.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def tiny_models(root: Path) -> Path:
    """The demo's base and three sparse agents (2 layers); their RAM+ config."""
    from mergekit_ram.commands.synthetic import build_models, merge_yaml

    config = root / "ramplus.yml"
    config.write_text(merge_yaml(build_models(str(root)), "ramplus"), encoding="utf-8")
    return config


def timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    try:
        config = tiny_models(root)
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        ours = str(BIN / "mergekit-ram")
        stock_merge = [str(BIN / "mergekit-yaml"), str(config), str(root / "o2")]
        cases = {
            "mergekit-ram --version": ([ours, "--version"], env),
            "mergekit-ram --help": ([ours, "--help"], env),
            "mergekit-ram demo --help": ([ours, "demo", "--help"], env),
            "mergekit-ram merge --help": ([ours, "merge", "--help"], env),
            "mergekit-yaml --help": ([str(BIN / "mergekit-yaml"), "--help"], env),
            "mergekit-ram merge (tiny)": (
                [ours, "merge", str(config), str(root / "o1"), "--quiet"],
                env,
            ),
            "mergekit-yaml (tiny)": ([*stock_merge, "--quiet"], env),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (command, environment) in cases.items():
                times[name].append(timed(command, environment))
        ratios = [
            a / b
            for a, b in zip(
                times["mergekit-ram merge (tiny)"], times["mergekit-yaml (tiny)"]
            )
        ]
        print(f"{args.rounds} rounds, whole processes, medians (min-max)")
        print("| command | seconds |")
        print("|---|---|")
        for name, values in times.items():
            print(
                f"| {name} | {statistics.median(values):.2f} "
                f"({min(values):.2f}-{max(values):.2f}) |"
            )
        print(
            f"| mergekit-ram merge / mergekit-yaml, pair by pair | "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
