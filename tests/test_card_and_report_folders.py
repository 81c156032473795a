"""The card names local folders offline without asking the hub, and a report
folder is checked like OUT: never inside an input, a full disk one error
after a complete merge."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from faults import ours_left, tmpfs, tree

from mergekit_ram.commands.cli import main

# Unset in a child that must see the hub as online and our autoload hook on.
ONLINE_UNSET = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MERGEKIT_RAM_AUTOLOAD")


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("publishing", seed=31)


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def relative_inputs(family, root: Path) -> Path:
    """ram.yml in root naming the family as `in/base`, `in/alpha`, ...: local
    folders spelled like hub ids, which mergekit's card asks the hub about."""
    (root / "in").mkdir()
    for name, path in family.paths.items():
        os.symlink(path, root / "in" / name)
    config = family.config_dict("ram")
    config["base_model"] = "in/base"
    config["models"] = [{"model": f"in/{t}"} for t in family.tasks]
    return write_config(root / "ram.yml", config)


def test_relative_one_slash_path_offline_keeps_card_and_merge(
    family, tmp_path, monkeypatch, caplog
):
    """`base_model: in/base` from a cwd where in/base exists: a path that
    exists here is the folder the merge read, never a hub id, so the hub is
    not asked and no warning is printed; the card names the folders."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "repo_exists", lambda *a, **k: asked.append(a))
    relative_inputs(family, tmp_path)
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["merge", "ram.yml", "out", "--quiet"])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert "in/base" in card and "huggingface.co/in/base" not in card
    assert asked == []
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    assert (out / "config.json").is_file()


def test_a_silent_hub_is_not_asked_about_local_folders(family, tmp_path):
    """HF_HUB_OFFLINE unset and a hub that accepts connections but never
    answers: mergekit's own lookup waited on it without end; stock
    mergekit-yaml now finishes without a connection to it or a warning
    (Issue 30 item 3: the warning named a 10 s wait in an 8.5 s run)."""
    relative_inputs(family, tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ONLINE_UNSET}
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen(8)
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{hub.getsockname()[1]}"
        env.update(HF_HUB_ETAG_TIMEOUT="2", HF_HOME=str(tmp_path / "hf"))
        command = [str(Path(sys.executable).parent / "mergekit-yaml"), "ram.yml", "out"]
        done = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        hub.setblocking(False)
        with pytest.raises(BlockingIOError):
            hub.accept()  # nobody connected
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "WARNING" in line] == []
    assert "in/base" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("command", ["merge", "analyze"])
def test_report_folder_inside_an_input_is_refused(family, tmp_path, command):
    """Item 4: `merge --report` / `analyze --out` into an input model folder."""
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    model = Path(family.paths["beta"])
    before = tree(model)
    args = [command, str(config)]
    args += [str(tmp_path / "out"), "--report"] if command == "merge" else ["--out"]
    result = CliRunner().invoke(main, [*args, str(model), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "Error: The report folder" in result.output
    assert "Traceback" not in result.output
    assert tree(model) == before and not (tmp_path / "out").exists()


def test_a_report_on_a_full_disk_is_one_error_after_a_complete_merge(family, tmp_path):
    with tmpfs(tmp_path / "small", "16k") as point:
        (point / "filler").write_bytes(b"\0" * 12_000)
        config = write_config(tmp_path / "ram.yml", family.config_dict("ramplus"))
        out = tmp_path / "out"
        args = ["merge", str(config), str(out), "--report", str(point / "r")]
        result = CliRunner().invoke(main, [*args, "--quiet"])
        assert result.exit_code == 2, result.output
        assert "Error: Writing the report into" in result.output
        assert "No space left on device" in result.output
        assert "Traceback" not in result.output
        assert (out / "config.json").is_file() and ours_left(out) == []


def test_an_interrupted_report_is_recognised_by_the_next_run(
    family, tmp_path, monkeypatch
):
    """Ctrl-C while the report's files are renamed in: report.json comes
    first, so what is left is a report of ours, and the same command runs."""
    import mergekit_ram.commands.report_files as report_files

    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    args = ["merge", str(config), str(tmp_path / "out"), "--report", "r", "--quiet"]
    renamed, replace = [], os.replace

    def interrupted(source: str, target: str) -> None:
        if os.path.abspath(target).startswith(str(tmp_path / "r")):
            if renamed:
                raise KeyboardInterrupt
            renamed.append(target)
        replace(source, target)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(report_files.os, "replace", interrupted)
    assert CliRunner().invoke(main, args).exit_code == 1  # click's "Aborted!"
    assert sorted(os.listdir(tmp_path / "r")) == ["report.json"]
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(main, args).exit_code == 0
    left = sorted(os.listdir(tmp_path / "r"))
    assert left[-2:] == ["report.json", "report.md"] and not left[0].startswith(".")


def test_report_of_another_method_leaves_its_merge_stocks(family, tmp_path):
    """`merge --report` of a task_arithmetic merge: mergekit's merge untouched
    (its card included), the report from one more read of the models."""
    document = family.config_dict(
        "task_arithmetic", model_parameters={t: {"weight": 0.5} for t in family.tasks}
    )
    config = write_config(tmp_path / "ta.yml", document)
    args = ["merge", str(config), str(tmp_path / "out"), "--quiet"]
    result = CliRunner().invoke(main, [*args, "--report", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert "task_arithmetic is not RAM: reading the models once" in result.output
    assert "ram_statistics.json" not in os.listdir(tmp_path / "out")
    assert "RAM" not in (tmp_path / "out" / "README.md").read_text()
