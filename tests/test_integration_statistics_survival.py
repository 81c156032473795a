"""Does RAM+'s λ survive the output dtype? Counted by the merge (the planner
gives the run a tally, the method counts into it, the last task writes it),
checked against the dense reference: RAM+ and RAM written in the same dtype,
compared on each task's unique elements."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import reference
import torch
import yaml
from conftest import read_json
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram

R = 0.002  # λ − 1 ≤ 0.004: lost in bf16 on most elements, never in float32


def reference_survival(family, written):
    base, tasks = family.state("base"), family.task_states()
    plus, lambdas = reference.merge(base, tasks, r=R, out_dtype=written)
    ram, _ = reference.merge(base, tasks, out_dtype=written)
    per_tensor = reference.counts(base, tasks, 1e-5)
    found = [[0, 0] for _ in tasks]
    for name, (_tau, m, c) in per_tensor.items():
        for t, counts in enumerate(found):
            unique = m[t] & (c == 1)
            counts[0] += int(unique.sum())
            counts[1] += int((plus[name] != ram[name])[unique].sum())
    return [tuple(counts) for counts in found], lambdas


def merge(text, out, device="cpu"):
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True, device=device))
    statistics = Path(out) / "ram_statistics.json"
    return read_json(statistics) if statistics.exists() else None


def lost_warnings(caplog) -> list[str]:
    said = [r.getMessage() for r in caplog.records]
    return [m for m in said if "out_dtype: float32" in m]


@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_statistics_count_what_survives(
    out_dtype, family_bf16, tmp_path, caplog, on_device
):
    """The whole merge (the statistics pass included) on `on_device`."""
    extra = {"out_dtype": out_dtype} if out_dtype else {}
    text = family_bf16.yaml("ramplus", parameters={"r": R}, **extra)
    with caplog.at_level(logging.WARNING, logger="mergekit_ram"):
        doc = merge(text, tmp_path / "out", on_device)
    written = getattr(torch, out_dtype or "bfloat16")
    want, lambdas = reference_survival(family_bf16, written)
    assert all(lam > 1 for lam in lambdas)
    rows = doc["tasks"]
    assert [(row["rescaled"], row["rescale_survived"]) for row in rows] == want
    assert doc["written_dtypes"] == [str(written).removeprefix("torch.")]
    card = (tmp_path / "out" / "README.md").read_text()
    assert "λ survives" in card
    lost = lost_warnings(caplog)
    if out_dtype is None:
        # bf16 loses most of it, and the merge says so once, with the fix.
        assert sum(s for _, s in want) < 0.5 * sum(n for n, _ in want)
        assert len(lost) == 1 and "twice the size" in lost[0]
        assert "out_dtype: float32" in card
    else:
        assert want == [(n, n) for n, _ in want]
        assert not lost


def test_explicit_scale_without_pass_still_warns(family_bf16, tmp_path, caplog):
    """No statistics pass (explicit λ), so no ram_statistics.json: the line only."""
    explicit = {name: {"unique_scale": 1.001} for name in family_bf16.tasks}
    text = family_bf16.yaml("ramplus", model_parameters=explicit)
    with caplog.at_level(logging.WARNING, logger="mergekit_ram"):
        assert merge(text, tmp_path / "out") is None
    assert len(lost_warnings(caplog)) == 1


def test_merge_tasks_on_worker_threads_count_into_their_run(
    family_bf16, tmp_path, monkeypatch
):
    """mergekit's --multi-gpu executor runs merge tasks on worker threads,
    which start without the merge's context: each task brings its run."""
    import mergekit.merge

    class ThreadedExecutor(mergekit.merge.Executor):
        def run(self, *args, **kwargs):
            results: list = []
            worker = threading.Thread(
                target=lambda: results.extend(super(ThreadedExecutor, self).run())
            )
            worker.start()
            worker.join()
            return iter(results)

    want, _ = reference_survival(family_bf16, torch.bfloat16)
    monkeypatch.setattr(mergekit.merge, "Executor", ThreadedExecutor)
    doc = merge(family_bf16.yaml("ramplus", parameters={"r": R}), tmp_path / "out")
    assert [(row["rescaled"], row["rescale_survived"]) for row in doc["tasks"]] == want
    assert all(rescaled > 0 for rescaled, _ in want)
