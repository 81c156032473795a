"""Whole merges (`run_merge`, `mergekit-ram merge`, real `mergekit-yaml`)
publish as the protocol does: a failed, interrupted or killed merge leaves
OUT as it was, never an output that loads as a model, and says so; a rerun
leaves exactly its merge and the user's files."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mergekit.merge
import pytest
from click.testing import CliRunner
from conftest import merge
from faults import (
    EXITS,
    SIGNALS,
    STATE,
    check_exit,
    default_signals,
    ours_left,
    raise_on,
    run_interrupted,
    writing,
)
from safetensors.torch import save_file

import mergekit_ram.integration.methods as methods
import mergekit_ram.integration.output_folder as output_folder
from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError

SHARDS = 16_000  # bytes: the tiny models' merges span several shards
LATE = "model.layers.1.mlp.down_proj.weight"  # merged after many others
# What a finished merge of the tiny models has (sharded: with an index).
COMPLETE = {"config.json", "README.md", "mergekit_config.yml", "ram_statistics.json"}


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("publishing", seed=21)


def cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, [*args, "--quiet"])
    assert result.exit_code == code, result.output
    return result.output


def hashes(folder: Path, volatile: bool = False) -> dict[str, str]:
    """sha256 of every file under folder but our own (by presence only for
    what every run writes anew: the card, the statistics, the recipe)."""
    return {
        str(p.relative_to(folder)): "present"
        if volatile
        and p.name in {"README.md", "ram_statistics.json", "mergekit_config.yml"}
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).parts[0] != STATE
    }


@pytest.fixture(scope="module")
def fresh(family, tmp_path_factory):
    """A sharded RAM+ merge into a new folder: what every rerun must equal."""
    out = tmp_path_factory.mktemp("fresh") / "out"
    merge(family.config_dict(), out, out_shard_size=SHARDS)
    assert COMPLETE | {"model.safetensors.index.json"} <= set(os.listdir(out))
    return out


@pytest.fixture(scope="module")
def poisoned(family, tmp_path_factory) -> str:
    """beta with a NaN in a late tensor: a merge that fails while merging."""
    path = tmp_path_factory.mktemp("poisoned") / "beta"
    shutil.copytree(family.paths["beta"], path)
    state = family.state("beta")
    state[LATE].view(-1)[3] = float("nan")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def with_model(config: dict, family, task: str, path: str) -> dict:
    for entry in config["models"]:
        if entry["model"] == family.paths[task]:
            entry["model"] = path
    return config


FAILURES = {  # mid-merge; after config.json was staged; writing the manifest
    "kernel error": (methods, "ram_merge_tensor", RuntimeError("boom"), 12),
    "Ctrl-C": (methods, "ram_merge_tensor", KeyboardInterrupt(), 12),
    "card error": (mergekit.merge, "generate_card", RuntimeError("card"), 1),
    "publish error": (
        output_folder.os,
        "replace",
        OSError(28, "No space left on device"),
        lambda src, dst: dst.endswith("manifest.json"),
    ),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_rerun_leaves_the_previous_merge_byte_for_byte(
    failure, family, fresh, tmp_path, monkeypatch
):
    out = tmp_path / "out"
    shutil.copytree(fresh, out)
    (out / "notes.txt").write_text("mine")
    before = hashes(out)
    module, name, error, nth = FAILURES[failure]
    raise_on(monkeypatch, module, name, error, nth)
    if isinstance(error, OSError):  # the environment: one error, where OUT stands
        said = re.escape(f"{error.strerror}; {out} is as it was")
        with pytest.raises(RAMInputError, match=said):
            merge(family.config_dict(), out, out_shard_size=SHARDS)
    else:  # Ctrl-C or a bug: the exception itself
        with pytest.raises(type(error)):
            merge(family.config_dict(), out, out_shard_size=SHARDS)
    monkeypatch.undo()
    assert hashes(out) == before and not ours_left(out)
    merge(family.config_dict(), out, out_shard_size=SHARDS)
    assert hashes(out, True) == {
        **hashes(fresh, True),
        "notes.txt": before["notes.txt"],
    }


def test_reruns_leave_exactly_their_merge_and_the_users_files(family, tmp_path):
    """Stale shards and the old tokenizer go; the user's notes, README (with
    --no-write-model-card) and tokenizer_notes.md stay."""
    out = tmp_path / "out"
    config = tmp_path / "ram.yml"
    config.write_text(family.yaml("ram"))
    cli("merge", str(config), str(out), "--out-shard-size", str(SHARDS))
    tokenizer = {n for n in os.listdir(out) if n.startswith("tokenizer")}
    assert tokenizer and "model.safetensors.index.json" in os.listdir(out)
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer_notes.md").write_text("the user's, not the merge's")
    (out / "README.md").write_text("my card")
    for _ in range(2):
        cli("merge", str(config), str(out), "--no-copy-tokenizer")
        cli(
            "merge",
            str(config),
            str(out),
            "--no-copy-tokenizer",
            "--no-write-model-card",
        )
    names = set(os.listdir(out))
    assert not tokenizer & names and not [n for n in names if "-of-" in n]
    assert (out / "notes.txt").read_text() == "mine" and ours_left(out) == []
    assert (out / "tokenizer_notes.md").read_text() == "the user's, not the merge's"
    out2 = tmp_path / "out2"
    out2.mkdir()
    (out2 / "README.md").write_text("my notes")
    cli("merge", str(config), str(out2), "--no-write-model-card")
    assert (out2 / "README.md").read_text() == "my notes"


def test_refused_before_anything_is_touched(family, fresh, tmp_path, monkeypatch):
    """A refused configuration, an OUT that is an input, an empty OUT path
    (also through stock mergekit-yaml): OUT and the inputs as they were."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    out = tmp_path / "out"
    shutil.copytree(fresh, out)
    before, inputs = hashes(out), hashes(Path(family.root))

    with pytest.raises(RAMInputError, match="saturation"):  # a bad value
        merge(family.config_dict(parameters={"saturation": "bogus"}), out)
    with pytest.raises(RAMInputError, match="would change an input"):
        merge(family.config_dict("ram"), Path(family.paths["gamma"]))
    config = tmp_path / "ram.yml"
    config.write_text(family.yaml("ram"))
    monkeypatch.chdir(out)
    result = CliRunner().invoke(mergekit_yaml, [str(config), "", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "Error: The output folder path is empty" in result.output
    assert hashes(out) == before and hashes(Path(family.root)) == inputs


def test_our_folder_removed_mid_merge_is_one_error(
    family, fresh, tmp_path, monkeypatch
):
    """`rm -rf OUT/.mergekit-ram` while the tensors merge: one `Error:`
    (exit 2) that truly says OUT is the old merge; the next run publishes."""
    out = tmp_path / "out"
    shutil.copytree(fresh, out)
    before = hashes(out)
    config = tmp_path / "ram.yml"
    config.write_text(family.yaml("ram"))
    real = methods.ram_merge_tensor

    def removing(*args, **kwargs):
        shutil.rmtree(out / STATE, ignore_errors=True)
        return real(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(methods, "ram_merge_tensor", removing)
        said = cli("merge", str(config), str(out), "--out-shard-size", "16000", code=2)
    assert said.startswith(f"Error: The merge into {out} stopped: No such file")
    assert f"{out} is as it was." in said and "Traceback" not in said
    assert hashes(out) == before and not ours_left(out)
    cli("merge", str(config), str(out), "--out-shard-size", "16000")
    assert (out / "config.json").is_file() and not ours_left(out)


def test_a_second_merge_into_out_fails_at_once(family, tmp_path):
    """A real second process holds OUT (as a merge in progress does)."""
    config = tmp_path / "ram.yml"
    config.write_text(family.yaml("ram"))
    out = tmp_path / "out"
    holder = writing(out)
    try:
        said = cli("merge", str(config), str(out), code=2)
        assert "Another merge is writing into" in said and holder.poll() is None
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.communicate(timeout=60)
    assert holder.returncode == 128 + signal.SIGTERM
    assert not out.exists()
    cli("merge", str(config), str(out))


STALLING = """
import sys, time
import mergekit_ram.integration.methods as method
real, calls = method.ram_merge_tensor, [0]
def slow(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 6:
        print("STALLED", flush=True)
        time.sleep(600)
    return real(*args, **kwargs)
method.ram_merge_tensor = slow
from mergekit.scripts.run_yaml import main
main([sys.argv[1], sys.argv[2], "--quiet"])
"""


@pytest.mark.parametrize(
    "sent, code, last",
    [
        ("SIGINT", 1, "Aborted!"),  # click's, as stock mergekit-yaml
        pytest.param("SIGTERM", 143, "is as it was.", marks=pytest.mark.slow),
    ],
)
def test_a_signal_mid_merge_through_mergekit_yaml(
    family, fresh, tmp_path, sent, code, last
):
    """Ctrl-C: our line, then click's `Aborted!`, exit 1; SIGTERM: our line,
    exit 143. The staging is removed, OUT is as it was."""
    out = tmp_path / "out"
    shutil.copytree(fresh, out)
    before = hashes(out)
    config = tmp_path / "ram.yml"
    config.write_text(family.yaml("ram"))
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLING, str(config), str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    line = proc.stdout.readline()
    if line.strip() != "STALLED":
        proc.kill()
        raise AssertionError(line + proc.communicate()[1])
    assert ours_left(out)  # the staging folder and the lock exist while it runs
    proc.send_signal(getattr(signal, sent))
    _, err = proc.communicate(timeout=120)
    name = {"SIGINT": "Ctrl-C"}.get(sent, sent)
    assert proc.returncode == code, err
    assert f"mergekit-ram: {name}: {out} is as it was." in err
    assert err.rstrip().endswith(last) and "Traceback" not in err
    assert hashes(out) == before and not ours_left(out)


@pytest.mark.slow
def test_mergekit_yaml_interrupted_at_every_publish_step(
    family, fresh, poisoned, tmp_path
):
    """Real mergekit-yaml killed (SIGKILL), terminated (SIGTERM), interrupted
    (SIGINT) or hung up on (SIGHUP) at every file-system step, the signal
    taking turns, over an older merge with the user's file; then a merge
    that fails (a NaN) and one that succeeds: OUT is the old merge, the new
    one or a folder without config.json; the failing run leaves it so; the
    succeeding one publishes exactly its merge."""
    older = tmp_path / "older"
    merge(family.config_dict("ram"), older, out_shard_size=SHARDS)
    (older / "notes.txt").write_text("mine")
    config = tmp_path / "ramplus.yml"
    config.write_text(family.yaml())

    def run(step: int, how: str, out: Path):
        args = [str(config), str(out), "--out-shard-size", str(SHARDS), "--quiet"]
        return run_interrupted(tmp_path, step, how, "mergekit-yaml", args)

    out = tmp_path / "count" / "out"
    shutil.copytree(older, out)
    code, output, steps = run(0, "SIGKILL", out)
    assert code == 0, output
    states = {"old": hashes(older, True), "new": hashes(out, True)}
    assert states["new"] == {
        **hashes(fresh, True),
        "notes.txt": states["old"]["notes.txt"],
    }

    def state(out: Path) -> str:
        found = hashes(out, True)
        name = next((k for k, v in states.items() if v == found), None)
        if name is None and "config.json" not in found:
            assert found["notes.txt"] == states["old"]["notes.txt"]
            ours = {k: (states["old"].get(k), states["new"].get(k)) for k in found}
            assert all(v in ours[k] for k, v in found.items()), found
            return "half"
        return name or f"mixed {found}"

    seen = set()
    for step in range(1, steps + 1):
        how = SIGNALS[step % len(SIGNALS)]
        out = tmp_path / f"{step}-{how}" / "out"
        shutil.copytree(older, out)
        code, output, _ = run(step, how, out)
        assert code in EXITS[how], (step, how, output[-2000:])
        found = state(out)
        seen.add(found)
        if how != "SIGKILL":
            check_exit(how, code, found, output[-2000:])
        with pytest.raises(RAMInputError, match="NaN"):
            merge(with_model(family.config_dict(), family, "beta", poisoned), out)
        assert state(out) == found and not ours_left(out), (step, how)
        merge(family.config_dict(), out, out_shard_size=SHARDS)
        assert state(out) == "new" and not ours_left(out), (step, how)
        shutil.rmtree(out.parent)
    assert {"old", "new", "half"} <= seen, seen
