"""One command for the mini Table 1: base → RL agents → probe → merges → eval → results.

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
from generation import MAX_NEW_TOKENS
from merges import console_script, merge_config, run_merge
from results import write_results
from rl import RLConfig, train_agent
from tasks import TASKS, fingerprint

STAGE_FILE = "stage.json"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cached(out_dir: Path, key: dict, build: Callable[[Path], object]) -> dict:
    """Build out_dir unless its stage.json equals key; return the key."""
    marker = out_dir / STAGE_FILE
    if marker.exists() and json.loads(marker.read_text()) == key:
        log(f"cached: {out_dir}")
        return key
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    started = time.perf_counter()
    build(out_dir)
    marker.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
    log(f"built {out_dir} in {time.perf_counter() - started:.0f} s")
    return key


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=str(Path(__file__).with_name("config.yaml"))
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: config's)"
    )
    parser.add_argument(
        "--only-agent",
        choices=list(TASKS),
        default=None,
        help="Build the base and this agent, then stop (to train agents in parallel).",
    )
    args = parser.parse_args(argv)
    settings = yaml.safe_load(Path(args.config).read_text())
    work = Path(settings["work_dir"])
    threads = args.threads or int(settings.get("threads", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    seed = int(settings.get("seed", 0))
    started = time.perf_counter()

    base_dir = work / "models" / "base"
    keys = {"base": cached(base_dir, {"gguf": GGUF_FILE}, build_base)}

    agents: dict[str, Path] = {}
    rl_seconds: dict[str, float] = {}
    for task in TASKS if args.only_agent is None else [args.only_agent]:
        rl = {
            key: value[task] if isinstance(value, dict) else value
            for key, value in settings["rl"].items()
        }
        rl_config = RLConfig(
            steps=int(rl["steps"]),
            prompts=int(rl["prompts"]),
            group=int(rl["group"]),
            temperature=float(rl["temperature"]),
            lr=float(rl["lr"]),
            seed=seed,
        )
        agents[task] = work / "models" / task
        key = {
            "base": keys["base"],
            "task": task,
            "task_fingerprint": fingerprint(TASKS[task], MAX_NEW_TOKENS[task]),
            "rl": vars(rl_config),
        }
        keys[task] = cached(
            agents[task],
            key,
            lambda out, t=task, c=rl_config: train_agent(base_dir, t, c, out, log),
        )
        rl_log = json.loads((agents[task] / "rl_log.json").read_text())
        rl_seconds[task] = rl_log["seconds"]
    if args.only_agent is not None:
        return

    merges = settings["merges"]
    probe_config = merge_config({"method": "ramplus"}, base_dir, agents)
    probe_dir = work / "probe"
    cached(
        probe_dir,
        {"agents": [keys[t] for t in TASKS]},
        lambda out: probe(probe_config, out),
    )

    merged: dict[str, Path] = {}
    for name, spec in merges.items():
        config = merge_config(spec, base_dir, agents)
        merged[name] = work / "merges" / name
        keys[name] = cached(
            merged[name],
            {
                "config": config,
                "spec": spec,
                "agents": [keys[t] for t in TASKS],
                "seed": seed,
            },
            lambda out, s=spec, c=config: run_merge(s, c, out, seed),
        )

    evaluation = settings["eval"]
    tasks = {n: fingerprint(t, MAX_NEW_TOKENS[n]) for n, t in TASKS.items()}
    rows: dict[str, dict] = {}
    models = {"base": base_dir, **{f"{t} agent": agents[t] for t in TASKS}, **merged}
    for label, model_dir in models.items():
        model_key = keys["base" if label == "base" else label.removesuffix(" agent")]
        eval_dir = work / "eval" / label.replace(" ", "_")
        cached(
            eval_dir,
            {"model": model_key, "eval": evaluation, "seed": seed, "tasks": tasks},
            lambda out, m=model_dir: (out / "scores.json").write_text(
                json.dumps(
                    evaluate_model(
                        m, int(evaluation["prompts"]), int(evaluation["batch"]), seed
                    ),
                    indent=1,
                )
            ),
        )
        rows[label] = json.loads((eval_dir / "scores.json").read_text())
        summary = " ".join(f"{t}={rows[label][t]['accuracy']:.2f}" for t in TASKS)
        log(f"{label}: {summary}")

    report = json.loads((probe_dir / "report.json").read_text())
    extra = {"rl_seconds": rl_seconds, "merges": merges, "config": args.config}
    paths = write_results(
        rows, report, int(evaluation["prompts"]), Path(settings["results_dir"]), extra
    )
    log(f"done in {time.perf_counter() - started:.0f} s: " + ", ".join(map(str, paths)))


if __name__ == "__main__":
    main()
