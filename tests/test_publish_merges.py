"""Whole merges (`run_merge`, `mergekit-ram merge`, real `mergekit-yaml`)
publish as the protocol does: a failed, interrupted or killed merge leaves
OUT as it was, never an output that loads as a model, and says so; a rerun
leaves exactly its merge and the user's files."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import mergekit.merge
import pytest
import safetensors.torch
from click.testing import CliRunner
from conftest import merge
from faults import STATE, Driver, ours_left, raise_on, settled, sweep, tree
from mergekit.scripts.run_yaml import main as mergekit_yaml

import mergekit_ram
import mergekit_ram.integration.methods as methods
from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.output_folder import staged_merge

SHARDS = 16_000  # bytes: the tiny models' merges span several shards
# What a finished merge of the tiny models has (sharded: with an index).
COMPLETE = {"config.json", "README.md", "mergekit_config.yml", "ram_statistics.json"}
# What every run writes anew (the card, the statistics, the recipe): compared
# by presence only.
ANEW = ("README.md", "ram_statistics.json", "mergekit_config.yml")


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("safety", seed=21)  # test_inputs_checked_never_written's


def cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, [*args, "--quiet"])
    assert result.exit_code == code, result.output
    return result.output


def config_file(family, folder: Path, method: str = "ram") -> str:
    (folder / f"{method}.yml").write_text(family.yaml(method))
    return str(folder / f"{method}.yml")


@pytest.fixture(scope="module")
def fresh(family, tmp_path_factory):
    """A sharded RAM+ merge into a new folder: what every rerun must equal."""
    out = tmp_path_factory.mktemp("fresh") / "out"
    merge(family.config_dict(), out, out_shard_size=SHARDS)
    assert COMPLETE | {"model.safetensors.index.json"} <= set(os.listdir(out))
    return out


FULL = OSError(errno.ENOSPC, "No space left on device", "model-1.safetensors")
FAILURES = {  # mid-merge; after config.json was staged; writing a shard
    "kernel error": (methods, "ram_merge_tensor", RuntimeError("boom"), 12),
    "Ctrl-C": (methods, "ram_merge_tensor", KeyboardInterrupt(), 12),
    "card error": (mergekit.merge, "generate_card", RuntimeError("card"), 1),
    "full disk": (safetensors.torch, "save_file", FULL, 1),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_rerun_leaves_the_previous_merge_byte_for_byte(
    failure, family, fresh, tmp_path, monkeypatch, capsys
):
    """A bug: one line saying OUT is as it was, then the exception itself; the
    environment: an OSError (its errno kept, for code that retries on it)
    that is one error saying why, where OUT stands and what to do; Ctrl-C
    through stock mergekit-yaml: our line, click's `Aborted!`, exit 1 (a real
    SIGINT mid-merge: test_mergekit_yaml_interrupted_at_every_step)."""
    out = tmp_path / "out"
    shutil.copytree(fresh, out)
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    raise_on(monkeypatch, *FAILURES[failure])
    if failure == "Ctrl-C":
        mergekit_ram.install()
        args = [config_file(family, tmp_path, "ramplus"), str(out), "--quiet"]
        result = CliRunner().invoke(mergekit_yaml, [*args, "--out-shard-size", "16000"])
        assert result.exit_code == 1, result.output
        assert f"mergekit-ram: Ctrl-C: {out} is as it was." in result.output
        assert result.output.rstrip().endswith("Aborted!")
    else:
        with pytest.raises(Exception) as raised:
            merge(family.config_dict(), out, out_shard_size=SHARDS)
        error, cause = raised.value, raised.value
        if failure == "full disk":
            assert isinstance(error, RAMInputError) and error.errno == errno.ENOSPC
            said = f"No space left on device (model-1.safetensors); {out} is as it was"
            assert f"{said}. Free space on that disk, then run" in str(error)
            while cause.__cause__ is not None:
                cause = cause.__cause__
            assert cause is FULL
        else:
            assert error is FAILURES[failure][2], error
            said = f"mergekit-ram: the merge stopped: {out} is as it was.\n"
            assert said in capsys.readouterr().err
    monkeypatch.undo()
    assert tree(out) == before and not ours_left(out)
    merge(family.config_dict(), out, out_shard_size=SHARDS)
    assert tree(out, ANEW) == {**tree(fresh, ANEW), "notes.txt": before["notes.txt"]}


def test_reruns_leave_exactly_their_merge_and_the_users_files(family, tmp_path):
    """Stale shards and the old tokenizer go; the user's notes, README (with
    --no-write-model-card) and tokenizer_notes.md stay."""
    out, config = tmp_path / "out", config_file(family, tmp_path)
    cli("merge", config, str(out), "--out-shard-size", str(SHARDS))
    tokenizer = {n for n in os.listdir(out) if n.startswith("tokenizer")}
    assert tokenizer and "model.safetensors.index.json" in os.listdir(out)
    (out / "notes.txt").write_text("mine")
    (out / "tokenizer_notes.md").write_text("the user's, not the merge's")
    (out / "README.md").write_text("my card")
    for _ in range(2):
        cli("merge", config, str(out), "--no-copy-tokenizer")
        cli("merge", config, str(out), "--no-copy-tokenizer", "--no-write-model-card")
    names = set(os.listdir(out))
    assert not tokenizer & names and not [n for n in names if "-of-" in n]
    assert (out / "notes.txt").read_text() == "mine" and ours_left(out) == []
    assert (out / "tokenizer_notes.md").read_text() == "the user's, not the merge's"
    out2 = tmp_path / "out2"
    out2.mkdir()
    (out2 / "README.md").write_text("my notes")
    cli("merge", config, str(out2), "--no-write-model-card")
    assert (out2 / "README.md").read_text() == "my notes"


def test_refused_before_anything_is_touched(family, fresh, tmp_path, monkeypatch):
    """A refused configuration (a bad value, a misspelt key), an OUT that is
    an input, an empty OUT path (through stock mergekit-yaml): OUT and the
    inputs as they were."""
    out = tmp_path / "out"
    shutil.copytree(fresh, out)
    before, inputs = tree(out), tree(Path(family.root))
    for key, value in (("saturation", "bogus"), ("epsilonn", 1e-5)):
        with pytest.raises(RAMInputError, match=key):
            merge(family.config_dict(parameters={key: value}), out)
    with pytest.raises(RAMInputError, match="would change an input"):
        merge(family.config_dict("ram"), Path(family.paths["gamma"]))
    config = config_file(family, tmp_path)
    monkeypatch.chdir(out)
    result = CliRunner().invoke(mergekit_yaml, [config, "", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "Error: The output folder path is empty" in result.output
    assert tree(out) == before and tree(Path(family.root)) == inputs


def test_our_folder_removed_mid_merge_is_one_error(
    family, fresh, tmp_path, monkeypatch
):
    """`rm -rf OUT/.mergekit-ram` while the tensors merge: one `Error:`
    (exit 2) that truly says OUT is the old merge; the next run publishes."""
    out, config = tmp_path / "out", config_file(family, tmp_path)
    shutil.copytree(fresh, out)
    before = tree(out)
    real = methods.ram_merge_tensor

    def removing(*args, **kwargs):
        shutil.rmtree(out / STATE, ignore_errors=True)
        return real(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(methods, "ram_merge_tensor", removing)
        said = cli("merge", config, str(out), "--out-shard-size", "16000", code=2)
    assert said.startswith(f"Error: The merge into {out} stopped: No such file")
    assert f"{out} is as it was." in said and "Traceback" not in said
    assert tree(out) == before and not ours_left(out)
    cli("merge", config, str(out), "--out-shard-size", "16000")
    assert (out / "config.json").is_file() and not ours_left(out)


def test_a_second_merge_into_out_fails_at_once(family, tmp_path):
    """While a merge writes into OUT (held here; in another process:
    test_publish_lock), `mergekit-ram merge` into it says so at once, exit 2."""
    out, config = tmp_path / "out", config_file(family, tmp_path)

    def second(staged: str) -> None:
        assert "Another merge is writing into" in cli("merge", config, str(out), code=2)

    staged_merge(str(out), second)
    cli("merge", config, str(out))
    assert (out / "config.json").is_file() and not ours_left(out)


@pytest.mark.slow
def test_mergekit_yaml_interrupted_at_every_step(family, fresh, tmp_path, monkeypatch):
    """faults.sweep of real mergekit-yaml over an older merge with the user's
    file, interrupted at every publish step and at every tensor it merges;
    then a merge that fails mid-merge and one that succeeds. What the
    protocol's sweep cannot check: a real signal while mergekit merges (its
    threads; SIGTERM exits 143, Ctrl-C through click), the real command's
    exit at each step, and a real merge's files (shards, index, card,
    statistics, tokenizer) in each state."""
    older = tmp_path / "older"
    merge(family.config_dict("ram"), older, out_shard_size=SHARDS)
    (older / "notes.txt").write_text("mine")
    config = config_file(family, tmp_path, "ramplus")
    driver = Driver("mergekit-yaml")

    def run(out: Path, step: int, how: str):
        args = [config, str(out), "--out-shard-size", str(SHARDS), "--quiet"]
        code, output, steps = driver.run(step, how, *args)
        aborted = code == 1 and "\nAborted!\nSTEPS " in output  # click's, exit 1
        assert how != "SIGINT" or aborted, output[-2000:]
        return code, output, steps

    def copy(name: str) -> Path:
        return Path(shutil.copytree(older, tmp_path / name / "out"))

    code, output, steps = run(copy("count"), 0, "SIGKILL")
    assert code == 0, output
    states = {"old": tree(older, ANEW), "new": tree(tmp_path / "count/out", ANEW)}
    assert states["new"] == {
        **tree(fresh, ANEW),
        "notes.txt": states["old"]["notes.txt"],
    }

    def fail(out: Path) -> None:
        with monkeypatch.context() as patched:
            raise_on(patched, methods, "ram_merge_tensor", RuntimeError("boom"), 12)
            with pytest.raises(RuntimeError, match="boom"):
                merge(family.config_dict(), out, out_shard_size=SHARDS)

    def state(out: Path) -> str:
        return settled(tree(out, ANEW), states, ("notes.txt",))

    def succeed(out: Path) -> None:
        merge(family.config_dict(), out, out_shard_size=SHARDS)

    try:
        assert {"old", "new", "half"} <= sweep(run, steps, copy, state, fail, succeed)
    finally:
        driver.close()
