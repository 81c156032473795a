"""The demo builds RL-like agents, merges through mergekit-yaml and explains it."""

import json
import os
import tempfile

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from mergekit_ram.commands.cli import main
from mergekit_ram.commands.demo import run_demo
from mergekit_ram.commands.synthetic import PAPER_LIKE


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("demo"))
    result = CliRunner().invoke(main, ["demo", "--out", root])
    assert result.exit_code == 0, result.output
    return root, result.output


def test_demo_writes_a_loadable_merge_with_statistics(demo_run):
    root, output = demo_run
    merged = os.path.join(root, "merged")
    for name in ("config.json", "model.safetensors", "ram_statistics.json"):
        assert os.path.exists(os.path.join(merged, name)), name
    assert "loads with transformers" in output
    assert merged in output


def test_demo_agents_look_like_the_papers(demo_run):
    root, output = demo_run
    with open(os.path.join(root, "merged", "ram_statistics.json")) as handle:
        document = json.load(handle)
    tasks = document["tasks"]
    assert len(tasks) == len(PAPER_LIKE)
    for task, spec in zip(tasks, PAPER_LIKE):
        density = task["changed"] / task["elements"]
        assert abs(density - spec.density) < 0.02, (spec.name, density)
        assert task["unique"] > 0 and task["shared"] > 0
        assert spec.name in output
    # Some element is changed by nobody: the demo exercises all three cases.
    assert any(t["changed"] < t["elements"] for t in tasks)
    for task in tasks:
        rho = task["shared"] / task["unique"]
        assert task["scale"] == 1 + document["r"] * min(rho, document["alpha"])


def test_demo_merge_moves_weights_by_the_printed_lambdas(demo_run):
    root, _ = demo_run
    base = load_file(os.path.join(root, "models", "base", "model.safetensors"))
    merged = load_file(os.path.join(root, "merged", "model.safetensors"))
    changed = sum(int((merged[k] != base[k]).sum()) for k in base)
    assert changed > 0
    assert all(merged[k].dtype == torch.bfloat16 for k in merged)


def test_run_demo_in_a_temporary_directory(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    merged = run_demo()
    assert merged.startswith(str(tmp_path))
    assert os.path.exists(os.path.join(merged, "config.json"))
    assert "Whole-model statistics" in capsys.readouterr().out


def test_cli_demo_without_out_removes_its_folder(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    assert "Whole-model statistics" in result.output
    assert f"Removed {tmp_path}" in result.output
    assert os.listdir(tmp_path) == []


def test_cli_demo_without_out_removes_its_folder_on_error(monkeypatch, tmp_path):
    def fail(root=None):
        # Like run_demo: a temporary folder of its own when given none.
        root = root or tempfile.mkdtemp(prefix="mergekit-ram-demo-")
        with open(os.path.join(root, "partial"), "w") as handle:
            handle.write("half a demo")
        raise KeyboardInterrupt

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("mergekit_ram.commands.demo.run_demo", fail)
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code != 0
    assert os.listdir(tmp_path) == []
