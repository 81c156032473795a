"""Paired bootstrap of any two evaluated rows of one regime, from the cached
test scores (the table compares every merge with one reference only):

    python benchmarks/agents/compare.py --regime heterogeneous ties ram ramplus

prints, for every row after the first, its average-over-tasks exact accuracy
minus the first row's on the same prompts, with the 95 % CI the table uses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from run import scores_dir
from stats import paired_bootstrap


def row_scores(work: Path, regime: str, row: str) -> dict:
    """A test row's scores.json: `base`, `<task> agent` or a merge's name."""
    path = scores_dir(work, regime, row)
    scores = path / "scores.json"
    if not scores.exists():
        raise SystemExit(f"{row!r} has no test scores under {path}: run run.py first")
    return json.loads(scores.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(Path(__file__).with_name("config.yaml"))
    )
    parser.add_argument("--work-dir", default=None, help="overrides the config's")
    parser.add_argument("--regime", required=True)
    parser.add_argument("reference", help="the row the others are compared with")
    parser.add_argument("rows", nargs="+")
    args = parser.parse_args(argv)
    settings = yaml.safe_load(Path(args.config).read_text())
    work = Path(args.work_dir or settings["work_dir"])
    resamples = int(settings["bootstrap"]["resamples"])
    seed = int(settings.get("seed", 0))
    reference = row_scores(work, args.regime, args.reference)
    for row in args.rows:
        paired = paired_bootstrap(
            row_scores(work, args.regime, row), reference, resamples, seed
        )
        low, high = (100 * bound for bound in paired["ci95"])
        print(
            f"{row} − {args.reference}: {100 * paired['difference']:+.1f} points "
            f"[{low:+.1f}, {high:+.1f}] (average over tasks, paired, 95 % CI)"
        )


if __name__ == "__main__":
    main()
