"""One command for the agents benchmark: base → RL agents per regime → probe →
merges (baselines tuned on validation) → test eval → paired comparison → results.

    python benchmarks/agents/run.py --config benchmarks/agents/config.yaml

Each stage's output directory holds a `stage.json` with the settings it was
built from, written last; a stage whose stage.json matches is reused, anything
else is rebuilt (and everything downstream of it, since keys chain).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from base import GGUF_FILE, build_base
from evaluate import evaluate_model
from filelock import FileLock
from generation import MAX_NEW_TOKENS
from merges import (
    console_script,
    grid_points,
    in_regime_dtype,
    merge_config,
    run_merge,
)
from results import keep_earlier_regimes, write_results
from rl import RLConfig, train_agent
from stats import paired_bootstrap, support_statistics
from tasks import TASKS, fingerprint

STAGE_FILE = "stage.json"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cached(out_dir: Path, key: dict, build: Callable[[Path], object]) -> dict:
    """Build out_dir unless its stage.json equals key; return the key.

    The build's wall time is kept in `seconds.json` next to stage.json, so a
    cached stage still reports what it cost when it was built. Runs of two
    regimes in parallel share stages (the base's evaluation): a lock next to
    out_dir makes the second wait for the first's build and reuse it."""
    marker = out_dir / STAGE_FILE
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(out_dir.parent / f".{out_dir.name}.lock"):
        if marker.exists() and json.loads(marker.read_text()) == key:
            log(f"cached: {out_dir}")
            return key
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        started = time.perf_counter()
        build(out_dir)
        seconds = round(time.perf_counter() - started, 1)
        (out_dir / "seconds.json").write_text(json.dumps({"seconds": seconds}) + "\n")
        marker.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    log(f"built {out_dir} in {seconds:.0f} s")
    return key


def scores_dir(work: Path, regime: str, row: str) -> Path:
    """Where a test row's scores live: `base` (shared by the regimes), `<task>
    agent` or a merge's name."""
    if row == "base":
        return work / "eval" / "base"
    return work / regime / "eval" / row.replace(" ", "_")


def stage_seconds(out_dir: Path) -> float | None:
    """What building out_dir took (None for stages built before this was kept)."""
    path = out_dir / "seconds.json"
    return json.loads(path.read_text())["seconds"] if path.exists() else None


def probe(config: dict, out_dir: Path) -> None:
    """`mergekit-ram analyze` on the agents: the report a user would read."""
    config_file = out_dir / "probe.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    command = [console_script("mergekit-ram"), "analyze"]
    command += [str(config_file), "--out", str(out_dir), "--r", "0,0.1,0.2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"probe failed:\n{result.stderr[-4000:]}")
    (out_dir / "probe.txt").write_text(result.stdout)


def rl_config(settings: dict, regime: str, task: str) -> RLConfig:
    """The regime's RL recipe for one task: `rl:` defaults, then the regime's
    overrides; any value may be a {task: value} mapping."""
    merged = {**settings["rl"], **(settings["regimes"][regime] or {})}
    value = {
        key: entry[task] if isinstance(entry, dict) else entry
        for key, entry in merged.items()
    }
    return RLConfig(
        steps=int(value["steps"]),
        prompts=int(value["prompts"]),
        group=int(value["group"]),
        temperature=float(value["temperature"]),
        lr=float(value["lr"]),
        seed=int(value.get("seed", 0)),
        master=str(value.get("master", "float32")),
        mask=float(value.get("mask", 1.0)),
        save=str(value.get("save", "bfloat16")),
    )


class Evaluator:
    """Cached per-prompt evaluation of checkpoints on one split."""

    def __init__(self, settings: dict, seed: int) -> None:
        self.eval = settings["eval"]
        self.seed = seed
        self.tasks = {n: fingerprint(t, MAX_NEW_TOKENS[n]) for n, t in TASKS.items()}

    def __call__(self, model_dir: Path, model_key: dict, out_dir: Path, split: str):
        prompts = int(self.eval[split])
        batch = int(self.eval["batch"])
        key = {
            "model": model_key,
            "split": split,
            "prompts": prompts,
            "batch": batch,
            "seed": self.seed,
            "tasks": self.tasks,
        }
        cached(
            out_dir,
            key,
            lambda out: (out / "scores.json").write_text(
                json.dumps(
                    evaluate_model(model_dir, split, prompts, batch, self.seed),
                    indent=1,
                )
            ),
        )
        scores = json.loads((out_dir / "scores.json").read_text())
        summary = " ".join(f"{t}={scores[t]['accuracy']:.3f}" for t in TASKS)
        log(f"{split} {out_dir.name}: {summary}")
        return scores


def mean_accuracy(scores: dict) -> float:
    return sum(scores[t]["accuracy"] for t in TASKS) / len(TASKS)


def run_regime(
    settings: dict,
    regime: str,
    work: Path,
    base: tuple[Path, dict, dict | None],
    evaluator: Evaluator | None,
    seed: int,
    reverse: bool = False,
) -> dict:
    """One regime: agents, probe, every merge, supports and retention (cheap,
    no evaluation), then, with an evaluator, the baselines tuned on validation,
    the test rows and the paired comparison with the best tuned baseline.

    `reverse` builds the same stages in another order (merges backwards; the
    fixed merges' test rows, validation backwards, the agents, then the tuned
    rows), so a second process on another core meets the first in the middle;
    the document is the same either way."""

    def ordered(items: list) -> list:
        return items[::-1] if reverse else items

    base_dir, _base_key, base_test = base
    root = work / regime
    agents: dict[str, Path] = {}
    keys: dict[str, dict] = {}
    recipes: dict[str, dict] = {}
    seconds: dict[str, dict] = {"rl": {}, "merge": {}, "eval": {}}
    for task in TASKS:
        agents[task], keys[task] = train_stage(settings, regime, task, work, base)
        rl_log = json.loads((agents[task] / "rl_log.json").read_text())
        seconds["rl"][task] = rl_log["seconds"]
        recipes[task] = rl_log["config"]
    agent_keys = [keys[t] for t in TASKS]

    # A regime whose agents are float32 releases is probed and merged in float32
    # too (unless a merge names its dtype): bf16 would round their updates away.
    merge_dtype = (settings["regimes"][regime] or {}).get("merge_dtype")

    probe_dir = root / "probe"
    probe_config = merge_config(
        in_regime_dtype({"method": "ramplus"}, merge_dtype), base_dir, agents
    )
    cached(
        probe_dir,
        {"agents": agent_keys, "config": probe_config},
        lambda out: probe(probe_config, out),
    )
    seconds["probe"] = stage_seconds(probe_dir)

    built: dict[str, tuple[Path, dict]] = {}  # every merge: fixed, then grid points

    def merge(name: str, spec: dict, out_dir: Path) -> None:
        spec = in_regime_dtype(spec, merge_dtype)
        config = merge_config(spec, base_dir, agents)
        key = {"config": config, "spec": spec, "agents": agent_keys, "seed": seed}
        cached(out_dir, key, lambda out: run_merge(spec, config, out, seed))
        built[name] = (out_dir, key)
        seconds["merge"][name] = stage_seconds(out_dir)

    grids = {name: grid_points(spec) for name, spec in settings["tuned"].items()}
    merges = [(n, spec, root / "merges" / n) for n, spec in settings["merges"].items()]
    merges += [
        (f"{name} {point_name}", point, root / "grid" / name / point_name)
        for name, points in grids.items()
        for point_name, point in points
    ]
    for name, spec, out_dir in ordered(merges):
        merge(name, spec, out_dir)
    built = {name: built[name] for name, _spec, _out in merges}

    support_dir = root / "support"
    cached(
        support_dir,
        {"agents": agent_keys, "merges": {n: k for n, (_, k) in built.items()}},
        lambda out: (out / "support.json").write_text(
            json.dumps(
                support_statistics(
                    base_dir, agents, {n: d for n, (d, _) in built.items()}
                ),
                indent=1,
            )
        ),
    )
    seconds["support"] = stage_seconds(support_dir)
    block = {
        "recipes": recipes,
        "support": json.loads((support_dir / "support.json").read_text()),
        "probe": json.loads((probe_dir / "report.json").read_text()),
        "seconds": seconds,
    }
    if evaluator is None:
        return block

    scores: dict[str, dict] = {}

    def test_rows(jobs: list[tuple[str, Path, dict, Path]]) -> None:
        for label, model_dir, key, eval_dir in jobs:
            scores[label] = evaluator(model_dir, key, eval_dir, "test")
            seconds["eval"][label] = stage_seconds(eval_dir)

    def validate(jobs: list[tuple[str, str]]) -> None:
        for name, point_name in jobs:
            model_dir, key = built[f"{name} {point_name}"]
            out = root / "validation" / name / point_name
            scores[f"validation {name} {point_name}"] = evaluator(
                model_dir, key, out, "validation"
            )

    agent_rows = [
        (f"{t} agent", agents[t], keys[t], scores_dir(work, regime, f"{t} agent"))
        for t in TASKS
    ]
    fixed_rows = [
        (n, *built[n], scores_dir(work, regime, n)) for n in settings["merges"]
    ]
    points = [(name, p) for name, grid in grids.items() for p, _point in grid]
    if reverse:
        test_rows(ordered(fixed_rows))
        validate(ordered(points))
        test_rows(ordered(agent_rows))
    else:
        test_rows(agent_rows)
        validate(points)
    tested: dict[str, tuple[Path, dict]] = {}
    tuned: dict[str, dict] = {}
    for name, grid_of in grids.items():
        grid = {}
        for point_name, _point in grid_of:
            validation = scores[f"validation {name} {point_name}"]
            grid[point_name] = {
                "validation_mean": mean_accuracy(validation),
                "validation": validation,
            }
        chosen = max(grid, key=lambda point_name: grid[point_name]["validation_mean"])
        tuned[name] = {"chosen": chosen, "grid": grid}
        tested[name] = built[f"{name} {chosen}"]
    test_rows(ordered([(n, *tested[n], scores_dir(work, regime, n)) for n in tuned]))
    if not reverse:
        test_rows(fixed_rows)
    tested.update({name: built[name] for name in settings["merges"]})
    rows: dict[str, dict] = {"base": base_test}
    rows.update({label: scores[label] for label, *_rest in agent_rows})
    rows.update({name: scores[name] for name in tested})

    # The best tuned baseline is chosen on validation too, never on test.
    def validation_mean(name: str) -> float:
        return tuned[name]["grid"][tuned[name]["chosen"]]["validation_mean"]

    reference = max(tuned, key=validation_mean)
    resamples = int(settings["bootstrap"]["resamples"])
    paired = {
        name: paired_bootstrap(rows[name], rows[reference], resamples, seed)
        for name in tested
        if name != reference
    }
    # Does each agent learn its task? Its own-task gain over the base, paired.
    own_task = {
        task: paired_bootstrap(
            rows[f"{task} agent"], base_test, resamples, seed, tasks=(task,)
        )
        for task in TASKS
    }
    retention = block["support"]["retention"]
    block["support"]["retention"] = {
        name: retention[
            name if name in settings["merges"] else f"{name} {tuned[name]['chosen']}"
        ]
        for name in tested
    }
    block["support"]["retention_all_merges"] = retention
    return {
        **block,
        "rows": rows,
        "tuned": tuned,
        "reference": reference,
        "paired": paired,
        "own_task_gain": own_task,
    }


def train_stage(
    settings: dict, regime: str, task: str, work: Path, base: tuple
) -> tuple[Path, dict]:
    """One agent of one regime (cached on its recipe and the task's fingerprint)."""
    base_dir, base_key, _ = base
    config = rl_config(settings, regime, task)
    out = work / regime / "models" / task
    key = {
        "base": base_key,
        "task": task,
        "task_fingerprint": fingerprint(TASKS[task], MAX_NEW_TOKENS[task]),
        "rl": vars(config),
    }
    cached(out, key, lambda o: train_agent(base_dir, task, config, o, log))
    return out, key


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(Path(__file__).with_name("config.yaml"))
    )
    parser.add_argument("--work-dir", default=None, help="overrides the config's")
    parser.add_argument(
        "--results-dir",
        default=None,
        help="overrides the config's (e.g. one per regime run in parallel)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: config's)"
    )
    parser.add_argument(
        "--regime", action="append", default=None, help="only this regime (repeatable)"
    )
    parser.add_argument(
        "--only-agent",
        choices=list(TASKS),
        default=None,
        help="Build the base and this agent, then stop (to train agents in parallel).",
    )
    parser.add_argument(
        "--reverse",
        action="store_true",
        help="Build the same stages in another order: a second process on another "
        "core meets the first in the middle (same results).",
    )
    parser.add_argument(
        "--no-eval",
        action="store_true",
        help="Stop before evaluating: agents, probe, merges, supports and retention "
        "only (the cheap half), written to WORK_DIR/supports.json.",
    )
    args = parser.parse_args(argv)
    settings = yaml.safe_load(Path(args.config).read_text())
    work = Path(args.work_dir or settings["work_dir"])
    threads = args.threads or int(settings.get("threads", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    seed = int(settings.get("seed", 0))
    regimes = args.regime or list(settings["regimes"])
    unknown = sorted(set(regimes) - set(settings["regimes"]))
    if unknown:
        raise SystemExit(
            f"--regime {unknown[0]!r} is not in {args.config}'s regimes: "
            f"{sorted(settings['regimes'])}"
        )
    started = time.perf_counter()

    base_dir = work / "base"
    base_key = cached(base_dir, {"gguf": GGUF_FILE}, build_base)
    if args.only_agent is not None:
        for regime in regimes:
            train_stage(
                settings, regime, args.only_agent, work, (base_dir, base_key, None)
            )
        return
    evaluator = None if args.no_eval else Evaluator(settings, seed)
    base_test = (
        None
        if evaluator is None
        else evaluator(base_dir, base_key, scores_dir(work, "", "base"), "test")
    )
    document = {
        "test_prompts_per_task": int(settings["eval"]["test"]),
        "validation_prompts_per_task": int(settings["eval"]["validation"]),
        "config": args.config,
        "base_eval_seconds": stage_seconds(scores_dir(work, "", "base")),
        "regimes": {},
    }
    for regime in regimes:
        document["regimes"][regime] = run_regime(
            settings,
            regime,
            work,
            (base_dir, base_key, base_test),
            evaluator,
            seed,
            args.reverse,
        )
    if evaluator is None:
        path = work / "supports.json"
        path.write_text(json.dumps(document, indent=1) + "\n")
        log(f"done (no evaluation) in {time.perf_counter() - started:.0f} s: {path}")
        return
    out_dir = Path(args.results_dir or settings["results_dir"])
    for regime in keep_earlier_regimes(document, out_dir, list(settings["regimes"])):
        log(f"kept {regime}'s block from {out_dir / 'results.json'} (not run now)")
    paths = write_results(document, out_dir)
    log(f"done in {time.perf_counter() - started:.0f} s: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
