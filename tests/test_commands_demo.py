"""The demo builds RL-like agents, merges through mergekit-yaml and explains it."""

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mergekit_ram.commands.cli import main
from mergekit_ram.commands.synthetic import PAPER_LIKE


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo into a folder that holds a file of the user's (like `--out .`
    in the repository)."""
    root = tmp_path_factory.mktemp("demo")
    (root / "README.md").write_text("mine")
    result = CliRunner().invoke(main, ["demo", "--out", str(root)])
    assert result.exit_code == 0, result.output
    return root, result.output


def test_demo_writes_a_loadable_merge_with_statistics(demo_run):
    root, output = demo_run
    # Other files stay; the demo adds only its three entries.
    assert sorted(os.listdir(root)) == ["README.md", "merged", "models", "ramplus.yml"]
    assert (root / "README.md").read_text() == "mine"
    merged = root / "merged"
    for name in ("config.json", "model.safetensors", "ram_statistics.json"):
        assert (merged / name).exists(), name
    assert "loads with transformers" in output and str(merged) in output


def test_demo_agents_look_like_the_papers(demo_run):
    root, output = demo_run
    document = json.loads((root / "merged" / "ram_statistics.json").read_text())
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


@pytest.mark.parametrize("fails", [False, True])
def test_cli_demo_without_out_removes_its_folder(monkeypatch, tmp_path, fails):
    """Also when it stops half-way (here: interrupted)."""

    def fail(root):
        (Path(root) / "partial").write_text("half a demo")
        raise KeyboardInterrupt

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    if fails:
        monkeypatch.setattr("mergekit_ram.commands.demo.run_demo", fail)
    result = CliRunner().invoke(main, ["demo"])
    assert (result.exit_code != 0) is fails and os.listdir(tmp_path) == []
    if not fails:
        assert "Whole-model overlap statistics" in result.output
        assert f"Removed {tmp_path}" in result.output


def snapshot(root) -> dict[str, tuple[bytes, int]]:
    """Every file under `root`: its bytes and modification time."""
    files = (p for p in Path(root).rglob("*") if p.is_file())
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def refused(out) -> str:
    result = CliRunner().invoke(main, ["demo", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    return result.output


@pytest.mark.parametrize(
    "own", [("models/coder/config.json", "ramplus.yml"), ("merged/notes.txt",)]
)
def test_demo_refuses_a_folder_holding_what_it_would_write(tmp_path, own):
    """A user's own models/coder/, ramplus.yml or merged/: one Error paragraph
    naming them, and every file as it was, nothing added."""
    for name in own:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"the user's {name}")
    (tmp_path / "unrelated.txt").write_text("kept")
    before = snapshot(tmp_path)
    output = refused(tmp_path)
    for name in own:
        assert str(tmp_path / name.split("/")[0]) in output
    assert "nothing was written" in output
    assert snapshot(tmp_path) == before


def test_demo_refuses_a_model_folder(family_f32, tmp_path):
    model = tmp_path / "coder"
    shutil.copytree(family_f32.paths["alpha"], model)
    before = snapshot(model)
    output = refused(model)
    assert "is a model folder" in output and "config.json" in output
    assert snapshot(model) == before


@pytest.mark.parametrize(
    ("under", "said"),
    [
        ("", "Invalid value for '--out'"),  # a folder option: click names it
        ("demo", "cannot be created (Not a directory)"),
    ],
)
def test_demo_refuses_a_file_or_a_folder_under_one(tmp_path, under, said):
    (tmp_path / "notes.txt").write_text("mine")
    target = tmp_path / "notes.txt" / under
    result = CliRunner().invoke(main, ["demo", "--out", str(target)])
    assert result.exit_code == 2 and said in result.output, result.output
    assert "is a file" in result.output or under
    assert "Traceback" not in result.output
    assert (tmp_path / "notes.txt").read_text() == "mine"
