"""The statistics pass: its read-ahead, and its memory.

It keeps about one tensor group in memory, not the model. Two families share
their largest tensor (and every tensor shape) but differ eight-fold in depth.
In a fresh interpreter each plans its merge (`plan_merges`) and samples
the process's anonymous resident memory while the statistics pass
(`collect_planned`) runs.

Why anonymous memory: safetensors hands out tensors that are views of the
memory-mapped checkpoint, so touched file pages count towards RSS (and
ru_maxrss) whether or not anything still references them: that is page
cache, not memory the pass holds. The checkpoints are bf16 and the merge asks
for `dtype: float32`, so every tensor the pass receives is an anonymous
float32 copy: a pass that kept groups alive would show up in RssAnon at full
size (4 bytes per element per model).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TaskSpec, build_family, merge_yaml, read_json

from mergekit_ram.integration.checkpoints import safetensors_spans

# --- read-ahead ---------------------------------------------------------------


def test_read_ahead_hints_each_input_tensor_once_and_changes_nothing(
    model_family, tmp_path, monkeypatch
):
    """Every input tensor's bytes are hinted once, in the real file; the
    merge and its statistics are those of a merge without hints (Windows has
    no posix_fadvise) or whose hints fail."""
    family = model_family("prefetch", tokenizer=False)
    advised: list[tuple[str, int, int]] = []

    def record(descriptor, start, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        advised.append((os.readlink(f"/proc/self/fd/{descriptor}"), start, length))

    def refuse(*_args):
        raise OSError(22, "Invalid argument")

    merges = []
    for how in ("hinted", "missing", "failing"):
        if how == "missing":
            monkeypatch.delattr(os, "posix_fadvise", raising=False)
        else:
            fadvise = record if how == "hinted" else refuse
            monkeypatch.setattr(os, "posix_fadvise", fadvise, raising=False)
        weights = merge_yaml(family.yaml("ramplus"), tmp_path / how)
        statistics = read_json(tmp_path / how / "ram_statistics.json")
        merges.append((weights, statistics, statistics.pop("seconds")))
    expected = set()
    for folder in family.paths.values():
        file = os.path.realpath(Path(folder) / "model.safetensors")
        spans = safetensors_spans(file).values()
        expected |= {(file, start, length) for start, length in spans}
    assert sorted(advised) == sorted(expected)
    (weights, statistics, _), *others = merges
    for other_weights, other_statistics, _ in others:
        assert other_statistics == statistics and other_weights.keys() == weights.keys()
        assert all(torch.equal(weights[k], other_weights[k]) for k in weights)


# --- memory -------------------------------------------------------------------

MEASURE = r"""
import gc, json, sys, threading, time
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram
from mergekit_ram.integration.statistics import collect_planned, plan_merges


def anon_kib():
    with open("/proc/self/status") as status:
        (line,) = [x for x in status if x.startswith("RssAnon:")]
    return int(line.split()[1])


def sample():
    while not stop.is_set():
        peak.append(anon_kib())
        time.sleep(0.002)


with open(sys.argv[1], encoding="utf-8") as handle:
    config = MergeConfiguration.model_validate(yaml.safe_load(handle))
options = MergeOptions(quiet=True)
merges = plan_merges(config, options)
gc.collect()
peak, stop = [anon_kib()], threading.Event()
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
stats = collect_planned(merges, options, epsilon=1e-5)
stop.set()
sampler.join()
result = dict(baseline_kib=peak[0], peak_kib=max(*peak, anon_kib()))
result.update(num_elements=stats.num_elements, tasks=len(stats.tasks))
print(json.dumps(result))
"""

SHAPE = dict(hidden=256, intermediate=1024, heads=4, kv_heads=4, vocab=256)
TASKS = (TaskSpec("a", density=0.05), TaskSpec("b", density=0.1))
DEPTHS = (4, 32)
PIPES = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def measurements(tmp_path_factory):
    """Both measurements; their checkpoints (about 220 MB) removed afterwards."""
    root = tmp_path_factory.mktemp("memory")
    procs, families, results = {}, {}, {}
    # Each measurement starts as soon as its family is written.
    for layers in DEPTHS:
        options = dict(layers=layers, dtype=torch.bfloat16, tokenizer=False, **SHAPE)
        families[layers] = family = build_family(root / f"{layers}", TASKS, **options)
        config = root / f"{layers}.yml"
        config.write_text(family.yaml("ramplus", dtype="float32"), encoding="utf-8")
        command = [sys.executable, "-c", MEASURE, str(config)]
        procs[layers] = subprocess.Popen(command, cwd=root, text=True, **PIPES)
    for layers, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        results[layers] = json.loads(out.strip().splitlines()[-1])
    yield families, results
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_statistics_pass_memory_follows_largest_group(measurements):
    families, results = measurements
    models = 1 + len(TASKS)
    bases = [families[d].state("base") for d in DEPTHS]
    # Same largest tensor, many more tensors.
    largest, other = (max(t.numel() for t in b.values()) for b in bases)
    assert largest == other
    float32_model = {
        d: 4 * sum(t.numel() for t in b.values()) for d, b in zip(DEPTHS, bases)
    }
    for d in DEPTHS:
        assert results[d]["num_elements"] * 4 == float32_model[d]
        assert results[d]["tasks"] == len(TASKS)
    # What the pass would hold if it kept every group (all models, float32).
    held_all = {d: models * float32_model[d] for d in DEPTHS}
    group_bytes = models * 4 * largest
    assert held_all[32] - held_all[4] > 40 * group_bytes

    growth = {d: 1024 * (r["peak_kib"] - r["baseline_kib"]) for d, r in results.items()}
    report = f"pass growth {growth}, largest group {group_bytes}, all inputs {held_all}"
    # The deeper model costs the pass (almost) nothing extra ...
    assert growth[32] - growth[4] < 0.05 * (held_all[32] - held_all[4]), report
    # ... and the pass itself stays within a handful of groups, far below
    # the model.
    assert growth[32] < 0.15 * held_all[32], report
