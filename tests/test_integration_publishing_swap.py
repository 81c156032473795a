"""A RAM merge never costs the user a file (publishing, output_folder, the card).

Issue findings 1-5 and 11, each reproduced as a new user would hit it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from faults import STATE, long_path, ours_left

import mergekit_ram.integration.methods
import mergekit_ram.integration.output_folder
from mergekit_ram.commands.cli import main

TIMEOUT = 300
# Unset in a child that must see the hub as online and our autoload hook on.
ONLINE_UNSET = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MERGEKIT_RAM_AUTOLOAD")


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("publishing", seed=31)


def hashes(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def previous(family, tmp_path_factory) -> Path:
    """A finished RAM merge, with a user's notes file next to it."""
    out = tmp_path_factory.mktemp("previous") / "out"
    config = write_config(out.parent / "ram.yml", family.config_dict("ram"))
    result = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    (out / "notes.txt").write_text("mine")
    return out


def copy_of(previous: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    return out


# --- 1. the offline card with a hub-like relative path ---------------------------


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
    family, previous, tmp_path, monkeypatch, caplog
):
    """`base_model: in/base` from a cwd where in/base exists: a path that
    exists here is the folder the merge read, never a hub id, so the hub is
    not asked and no warning is printed; the card names the folders."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "repo_exists", lambda *a, **k: asked.append(a))
    relative_inputs(family, tmp_path)
    out = copy_of(previous, tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["merge", "ram.yml", "out", "--quiet"])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert "in/base" in card and "huggingface.co/in/base" not in card
    assert asked == []
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    assert (out / "config.json").is_file() and (out / "notes.txt").exists()


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
        done = subprocess.run(
            [str(Path(sys.executable).parent / "mergekit-yaml"), "ram.yml", "out"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        hub.setblocking(False)
        with pytest.raises(BlockingIOError):
            hub.accept()  # nobody connected
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "WARNING" in line] == []
    assert "in/base" in (tmp_path / "out" / "README.md").read_text()


def test_card_lookup_of_a_local_folder_only_inside_a_ram_merge(tmp_path, monkeypatch):
    """Offline, mergekit's is_hf raises for an existing `in/base`; other
    methods keep that behaviour; in a RAM merge an existing folder is local."""
    import mergekit.card
    from huggingface_hub.errors import OfflineModeIsEnabled

    from mergekit_ram import install
    from mergekit_ram.integration.context import merge_run

    install()
    (tmp_path / "in" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hasattr(mergekit.card.is_hf, "__mergekit_ram__")
    with pytest.raises(OfflineModeIsEnabled):
        mergekit.card.is_hf("in/base")
    with merge_run():
        assert mergekit.card.is_hf("in/base") is False
        assert mergekit.card.is_hf("org/elsewhere") is True  # mergekit's own rule


# --- 2. a failing rerun keeps the previous merge, recipe included ----------------


def test_failing_rerun_of_outs_own_recipe_keeps_everything(family, previous, tmp_path):
    out = copy_of(previous, tmp_path)
    before = hashes(out)
    recipe = yaml.safe_load((out / "mergekit_config.yml").read_text())
    recipe["parameters"] = {"nonfinite": "refuse"}
    # A NaN found while streaming: one task model replaced by a poisoned copy.
    poisoned = tmp_path / "poisoned"
    shutil.copytree(family.paths["beta"], poisoned)
    from safetensors.torch import load_file, save_file

    state = load_file(str(poisoned / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"].view(-1)[3] = float("nan")
    save_file(state, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    recipe["models"][1]["model"] = str(poisoned)
    (out / "mergekit_config.yml").write_text(yaml.safe_dump(recipe))
    before = hashes(out)
    result = CliRunner().invoke(
        main, ["merge", str(out / "mergekit_config.yml"), str(out), "--quiet"]
    )
    assert result.exit_code == 2 and "NaN" in result.output
    assert hashes(out) == before
    assert not ours_left(out)


# --- 3. --no-write-model-card keeps a user's README.md --------------------------


def test_no_card_keeps_users_readme(family, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    result = CliRunner().invoke(
        main, ["merge", str(config), str(out), "--no-write-model-card", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert (out / "README.md").read_text() == "my notes"
    assert (out / "config.json").is_file()


# --- 4. two merges into one OUT at once -----------------------------------------


def test_second_concurrent_merge_fails_at_once_and_first_succeeds(family, tmp_path):
    """A real second process holds OUT (as a merge in progress does)."""
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            # Loaded by path: standard library only, starts in a blink.
            "import importlib.util, sys, time\n"
            "spec = importlib.util.spec_from_file_location('p', sys.argv[2])\n"
            "publishing = sys.modules['p'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(publishing)\n"
            "def write(staged):\n"
            "    print('WRITING', flush=True); time.sleep(600)\n"
            "publishing.staged_merge(sys.argv[1], write)\n",
            str(out),
            mergekit_ram.integration.output_folder.__file__,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "WRITING", holder.stderr.read()
        second = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
        assert holder.poll() is None  # refused while the first still runs
        assert second.exit_code == 2, second.output
        assert "Another merge is writing into" in second.output
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.communicate(timeout=TIMEOUT)
    assert holder.returncode == 128 + signal.SIGTERM
    assert not out.exists() and not ours_left(out)
    first = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
    assert first.exit_code == 0, first.output
    assert (out / "config.json").is_file() and not ours_left(out)


# --- 5. SIGTERM -------------------------------------------------------------------


STALLING_MERGE = """
import sys, time
import mergekit_ram.integration.methods as method
real = method.ram_merge_tensor
calls = [0]
def slow(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 6:
        print("STALLED", flush=True)
        time.sleep(600)
    return real(*args, **kwargs)
method.ram_merge_tensor = slow
from mergekit_ram.commands.cli import main
main(["merge", sys.argv[1], sys.argv[2], "--quiet"])
"""


@pytest.mark.slow  # a whole merge in a fresh process
def test_sigterm_mid_merge_leaves_out_as_it_was(family, previous, tmp_path):
    out = copy_of(previous, tmp_path)
    before = hashes(out)
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLING_MERGE, str(config), str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if line.strip() != "STALLED":
        proc.kill()
        raise AssertionError(line + proc.communicate()[1])
    assert ours_left(out)  # the staging folder and the lock exist while it runs
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert hashes(out) == before
    assert not ours_left(out)


# --- 11. an OUT that is a file; a new OUT after a failure --------------------------


def test_out_that_is_a_file_is_refused_untouched(family, tmp_path):
    out = tmp_path / "out"
    out.write_text("a file")
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    result = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "is a file, not a folder" in result.output
    assert out.read_text() == "a file"
    assert sorted(os.listdir(tmp_path)) == ["out", "ram.yml"]


# --- issue 17: report folders, names and paths a new user tries ------------------


@pytest.mark.parametrize("command", ["merge", "analyze"])
def test_report_folder_inside_an_input_is_refused(family, tmp_path, command):
    """Item 4: `merge --report` / `analyze --out` into an input model folder."""
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    model = Path(family.paths["beta"])
    before = hashes(model)
    args = [command, str(config)]
    args += [str(tmp_path / "out"), "--report"] if command == "merge" else ["--out"]
    result = CliRunner().invoke(main, [*args, str(model), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "Error: The report folder" in result.output
    assert "Traceback" not in result.output
    assert hashes(model) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "spell, message",
    [
        (lambda t: t / ("x" * 240), None),
        (lambda t: long_path(t, 3950), None),
        (lambda t: (t / "file").touch() or t / "file" / "out", "a file"),
        (lambda t: os.symlink(t / "l", t / "l") or t / "l" / "out", "symlink loop"),
    ],
    ids=[
        "240-character name",
        "3950-character path",
        "parent is a file",
        "symlink loop",
    ],
)
def test_output_paths_a_new_user_tries(family, tmp_path, spell, message):
    """Item 6, whole merges: long names and paths work (issue 36, problem 4:
    wherever stock mergekit writes, we do); the others are one Error."""
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    out = spell(tmp_path)
    result = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
    if message is None:
        assert result.exit_code == 0, result.output
        assert (out / "config.json").is_file() and not ours_left(out)
    else:
        assert result.exit_code == 2, result.output
        assert result.output.startswith("Error: The output folder")
        assert message in result.output and "Traceback" not in result.output


# --- issue 27: a merge touches only its own files --------------------------------


def test_an_empty_output_path_merges_nowhere(family, tmp_path, monkeypatch):
    """Item 7: `mergekit-ram merge cfg.yml "$OUTDIR"` with OUTDIR unset used
    to replace the current folder; now it is one Error and nothing is written
    (also through stock mergekit-yaml)."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')")
    config = write_config(project / "ram.yml", family.config_dict("ram"))
    monkeypatch.chdir(project)
    before = hashes(project)
    for command, args in ((main, ["merge"]), (mergekit_yaml, [])):
        result = CliRunner().invoke(command, [*args, str(config), "", "--quiet"])
        assert result.exit_code == 2, result.output
        assert "Error: The output folder path is empty" in result.output
        assert hashes(project) == before and sorted(os.listdir(project)) == [
            "ram.yml",
            "train.py",
        ]


def test_a_rerun_without_the_tokenizer_leaves_none_of_the_old_one(family, tmp_path):
    """Item 10: merge A, then B with --no-copy-tokenizer: OUT holds exactly B
    and the user's files, not A's tokenizer files."""
    out = tmp_path / "out"
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    result = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    tokenizer = {n for n in os.listdir(out) if n.startswith("tokenizer")}
    assert tokenizer, os.listdir(out)
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer_notes.md").write_text("the user's, not the merge's")
    args = ["merge", str(config), str(out), "--quiet", "--no-copy-tokenizer"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert not tokenizer & set(os.listdir(out))
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "tokenizer_notes.md").read_text() == "the user's, not the merge's"
    assert ours_left(out) == []


@pytest.mark.parametrize("command", ["merge", "analyze"])
def test_a_report_folder_under_a_file_is_refused_before_the_merge(
    family, tmp_path, command
):
    """Item 11: `--report` / `analyze --out` under a file was a traceback
    after the whole merge."""
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    (tmp_path / "afile").write_text("x")
    args = [command, str(config)]
    args += [str(tmp_path / "out"), "--report"] if command == "merge" else ["--out"]
    result = CliRunner().invoke(main, [*args, str(tmp_path / "afile" / "r"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "Error: The report folder" in result.output and "which is a file" in (
        result.output
    )
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_report_on_a_full_disk_is_one_error_after_a_complete_merge(family, tmp_path):
    point = tmp_path / "small"
    point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
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
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_a_model_folder_in_a_symlink_loop_is_named_as_such(family, tmp_path):
    """Item 11: it was reported as "does not exist"."""
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    config = family.config_dict("ram")
    config["models"][0]["model"] = str(tmp_path / "loop")
    path = write_config(tmp_path / "ram.yml", config)
    result = CliRunner().invoke(main, ["merge", str(path), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "is (or lies under) a symlink loop" in result.output


def test_a_merge_without_card_can_be_merged_over(family, tmp_path):
    """`--no-write-model-card` writes no mergekit_config.yml; the manifest
    says the weights are a merge's, so the same command runs twice."""
    out = tmp_path / "out"
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    args = ["merge", str(config), str(out), "--quiet", "--no-write-model-card"]
    for _ in range(2):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    assert "mergekit_config.yml" not in os.listdir(out) and ours_left(out) == []


# --- issue 36: the OS or a user in the way of a whole merge -----------------------


def remove_our_folder_mid_merge(monkeypatch, out: Path) -> None:
    """`rm -rf OUT/.mergekit-ram` while the tensors are merged."""
    methods, calls = mergekit_ram.integration.methods, []
    real = methods.ram_merge_tensor

    def removing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            shutil.rmtree(out / STATE)
        return real(*args, **kwargs)

    monkeypatch.setattr(methods, "ram_merge_tensor", removing)


def refuse_step(name: str, code: int, when):
    """output_folder's os.<name>(path) fails with `code` where when(path, OUT)."""

    def install(monkeypatch, out: Path) -> None:
        real = getattr(os, name)

        def refused(*args, **kwargs):
            path = str(args[-1])
            if when(path, out):
                raise OSError(code, os.strerror(code), path)
            return real(*args, **kwargs)

        monkeypatch.setattr(mergekit_ram.integration.output_folder.os, name, refused)

    return install


def users(found: dict[str, str]) -> dict[str, str]:
    """OUT's files but our folder (the manifest may be gone or name more)."""
    return {k: v for k, v in found.items() if not k.startswith(STATE)}


IN_THE_WAY = {  # problem: (what goes wrong, where OUT is then)
    "rm -rf .mergekit-ram mid-merge": (remove_our_folder_mid_merge, "is as it was"),
    "the manifest refused (EPERM)": (
        refuse_step("replace", 1, lambda p, out: p.endswith("manifest.json")),
        "is as it was",
    ),
    "a full disk at the manifest": (
        refuse_step("replace", 28, lambda p, out: p.endswith("manifest.json")),
        "is as it was",
    ),
    "OUT immutable right after the manifest": (
        refuse_step("unlink", 1, lambda p, out: p == str(out / "config.json")),
        "is as it was",
    ),
}


@pytest.mark.parametrize("problem", sorted(IN_THE_WAY))
def test_the_os_or_a_user_in_the_way_is_one_error_saying_where_out_stands(
    family, previous, tmp_path, monkeypatch, problem
):
    """Issue 36, problems 6-9: a traceback or a wrong message each, now one
    `Error:` line (exit 2) that truly says OUT is the old merge; the next
    run publishes."""
    out = copy_of(previous, tmp_path)
    before = hashes(out)
    config = write_config(tmp_path / "ram.yml", family.config_dict("ram"))
    install, said = IN_THE_WAY[problem]
    install(monkeypatch, out)
    result = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
    monkeypatch.undo()
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"Error: The merge into {out} stopped: ")
    assert f"{out} {said}." in result.output and "Traceback" not in result.output
    assert users(hashes(out)) == users(before) and not ours_left(out), result.output
    result = CliRunner().invoke(main, ["merge", str(config), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file() and not ours_left(out)
