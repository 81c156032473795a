"""A merge touches only its own files: OUT is the user's folder (notes, a
`.git`, a link, a read-only file, a mount, another program writing), and our
state in it is untrusted input. The protocol with a stand-in for mergekit
(faults.writer); whole merges in test_publish_merges.py."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from faults import (
    MANIFEST,
    NEW,
    NEWER,
    OLD,
    SAID,
    STATE,
    expected,
    failing,
    make_previous,
    ours_left,
    raise_on,
    settled,
    tree,
    user_tree,
    writer,
)

import mergekit_ram.integration.output_folder as output_folder
from mergekit_ram.integration.output_folder import OutputError, staged_merge


def manifest(out: Path) -> list | None:
    path = out / STATE / MANIFEST
    return json.loads(path.read_text())["files"] if path.exists() else None


def test_publish_replaces_the_old_merge_and_keeps_user_files(previous, tmp_path):
    """The old merge's shards, index and tokenizer go; the user's files stay
    byte for byte; only the manifest (and its .gitignore) is left of ours.
    OUT has a long odd name and is reached through a symlink."""
    out = tmp_path / ("m é$ 'x\"" + "m" * 230)
    previous.rename(out)
    os.symlink(out, tmp_path / "link")
    staged_merge(str(tmp_path / "link"), writer(NEW))
    assert (tmp_path / "link").is_symlink()
    assert tree(out) == expected(NEW, tmp_path / "want")
    assert sorted(name for name, *_ in manifest(out)) == sorted(NEW)
    assert ours_left(out) == []


def test_a_git_clone_as_out_commits_only_the_merge(previous):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    shutil.rmtree(previous / ".git")
    git = ["git", "-C", str(previous), "-c", "user.name=u", "-c", "user.email=u@x"]
    subprocess.run([*git, "init", "-q"], check=True)
    staged_merge(str(previous), writer(NEW))
    subprocess.run([*git, "add", "-A"], check=True)
    listed = subprocess.run(
        [*git, "ls-files"], check=True, capture_output=True, text=True
    ).stdout.split()
    assert "config.json" in listed and not [n for n in listed if STATE in n]


def test_no_file_is_taken_for_a_merges_by_its_name(previous, tmp_path):
    """A file the user changed since the merge wrote it is theirs; a .bin the
    user put beside a stock merge (no manifest) stays; same-named files are
    replaced, as stock mergekit replaces them. A manifest copied with its
    mtimes (`cp -a`) to ext4 with 128-byte inodes keeps whole seconds, FAT
    two: the old merge is still ours, so its shards and index go."""
    for name, _size, mtime in manifest(previous):
        grain = 2 * 10**9 if name.startswith("model-") else 10**9
        os.utime(previous / name, ns=(mtime, mtime - mtime % grain))
    (previous / "tokenizer.json").write_text("my own tokenizer now")
    staged_merge(str(previous), writer(NEW))
    assert tree(previous) == {
        **expected(NEW, tmp_path / "new"),
        "tokenizer.json": tree(previous)["tokenizer.json"],
    }
    assert (previous / "tokenizer.json").read_text() == "my own tokenizer now"
    stock = tmp_path / "stock"
    stock.mkdir()
    writer({**NEW, "pytorch_model.bin": "the user's own model"})(str(stock))
    staged_merge(str(stock), writer(NEWER))
    assert tree(stock) == {
        **expected(NEWER, tmp_path / "want", user=False),
        "pytorch_model.bin": tree(stock)["pytorch_model.bin"],
    }


def test_a_file_in_the_way_is_refused_never_deleted(tmp_path):
    """Weights a loader would take instead of the merge's (the user's
    model.safetensors beside a sharded merge, a stock index beside a single
    file) are refused by name before anything is published; in the way of
    every layout, before merging; so is a folder where the merge writes a file."""
    out = tmp_path / "out"
    staged_merge(str(out), writer(NEW))
    (out / "model.safetensors").write_text("the user's fine-tune, longer")
    before = tree(out)
    with pytest.raises(OutputError, match="holds model.safetensors, which no merge"):
        staged_merge(str(out), writer(OLD))
    assert tree(out) == before and ours_left(out) == []
    stock = tmp_path / "stock"
    stock.mkdir()
    writer(OLD)(str(stock))
    with pytest.raises(OutputError, match="holds model.safetensors.index.json"):
        staged_merge(str(stock), writer(NEW))
    staged_merge(str(stock), writer(OLD))  # the same layout replaces each by name
    (stock / "README.md").unlink()
    (stock / "README.md").mkdir()
    (stock / "README.md" / "mine.txt").write_text("mine")
    before = tree(stock)
    with pytest.raises(OutputError, match="holds a folder named README.md"):
        staged_merge(str(stock), writer(OLD))
    assert tree(stock) == before and ours_left(stock) == []
    both = tmp_path / "both"
    both.mkdir()
    writer({"model.safetensors": "a", "model.safetensors.index.json": "b"})(str(both))
    called, before = [], tree(both)
    with pytest.raises(OutputError, match="model.safetensors, model.safetensors.i"):
        staged_merge(str(both), called.append)
    assert not called and tree(both) == before


@pytest.mark.parametrize("where", ["new", "parents", "previous", "the user's"])
def test_a_failed_merge_leaves_out_as_it_was(tmp_path, where):
    """Folders the run made go; a previous merge stays, manifest included; the
    user's empty folder (mode 2770) stays, a killed run's staging and lock
    gone; the error names the OS's reason."""
    out = tmp_path / ("a/b/out" if where == "parents" else "out")
    if where == "previous":
        make_previous(tmp_path)
    elif where == "the user's":
        out.mkdir()
        out.chmod(0o2770)
    before = tree(tmp_path), manifest(out)
    if where == "the user's":  # what a killed run leaves (test_publish_kills)
        (out / STATE / "staged" / "merge").mkdir(parents=True)
        (out / STATE / "lock").touch()
    with pytest.raises(OutputError, match="No space left on device.* is as it was"):
        staged_merge(str(out), failing)
    assert (tree(tmp_path), manifest(out)) == before
    assert not out.exists() or ours_left(out) == []
    assert where != "the user's" or out.stat().st_mode & 0o7777 == 0o2770


def long_path(root: Path, length: int) -> Path:
    """A path of `length` characters below root, in names of up to 200."""
    path = str(root)
    while len(path) < length:
        path += "/" + "d" * min(200, length - len(path) - 1)
    return Path(path)


def test_an_out_path_too_long_for_the_staging_is_the_oss_error(tmp_path):
    """Stock mergekit writes OUT/name; we stage in OUT/.mergekit-ram/staged/
    merge/name, 27 characters more: the longest OUT that works, and beyond
    it the OS's "File name too long" with OUT as it was."""
    limit = (
        os.pathconf("/", "PC_PATH_MAX") - 1 - len("/model-00001-of-00002.safetensors")
    )
    longest = limit - len("/.mergekit-ram/staged/merge")
    files = {**NEW, "model-00001-of-00002.safetensors": "w"}
    out = long_path(tmp_path, longest)
    staged_merge(str(out), writer(files))
    assert (out / "config.json").read_text() == NEW["config.json"]
    out = long_path(tmp_path / "x", limit)  # stock mergekit merges into this
    with pytest.raises(OSError, match="File name too long.* is as it was"):
        staged_merge(str(out), writer(files))
    assert not (tmp_path / "x").exists()


def test_files_written_into_out_during_the_merge_and_publish_survive(
    previous, tmp_path
):
    """Another writer puts OUT/logs/N.txt there every 2 ms throughout."""
    written, done = [], threading.Event()

    def logging() -> None:
        (previous / "logs").mkdir()
        while not done.is_set():
            (previous / "logs" / f"{len(written)}.txt").write_text("log")
            written.append(len(written))
            time.sleep(0.002)

    other = threading.Thread(target=logging)
    other.start()
    try:
        for files in (NEW, NEWER, NEW):
            staged_merge(
                str(previous), lambda s, f=files: time.sleep(0.1) or writer(f)(s)
            )
    finally:
        done.set()
        other.join()
    logs = sorted(os.listdir(previous / "logs"), key=lambda n: int(n.split(".")[0]))
    assert len(written) > 20 and logs == [f"{n}.txt" for n in written]


# --- our state in OUT is untrusted input -------------------------------------------


HOSTILE = ("names the user's files", "leads elsewhere", "garbage", "a symlink")
STAGING = ("a link", "holding a link", "a file")


@pytest.mark.parametrize(
    "hostile",
    [
        *(f"a manifest: {h}" for h in (*HOSTILE, "a fifo")),
        *(f"staging: {s}" for s in STAGING),
    ],
)
def test_our_state_from_a_clone_copy_or_killed_run_costs_no_user_file(
    previous, tmp_path, hostile
):
    """Anything malformed in a manifest counts as no manifest, a link is not
    followed, an entry never leads out of OUT; leftover staging is removed,
    never through a link."""
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "precious.txt").write_text("precious")
    path, staging = previous / STATE / MANIFEST, previous / STATE / "staged"
    notes = os.lstat(previous / "notes.txt")
    wrong = [notes.st_size, notes.st_mtime_ns + 1]
    names = ("../theirs/precious.txt", "/etc/hostname", "eval/scores.csv", "..")
    if hostile.startswith("a manifest"):
        path.unlink()
    if hostile.endswith("garbage"):
        path.write_bytes(b"\x00{not json")
    elif hostile.endswith("a fifo"):  # opening it to read would block
        os.mkfifo(path)
    elif hostile == "a manifest: a symlink":
        (tmp_path / "theirs.json").write_text(json.dumps({"files": []}))
        os.symlink(tmp_path / "theirs.json", path)
    elif hostile.startswith("a manifest"):
        files = [[n, *wrong] for n in names]
        if hostile.endswith("names the user's files"):
            files = [["notes.txt", *wrong], [".git", 4096, 0], ["x", 1, True]]
        path.write_text(json.dumps({**output_folder.FORMAT, "files": files}))
    elif hostile.endswith("a file"):
        staging.write_text("a killed run's, or a clone's")
    elif hostile.endswith("holding a link"):
        (staging / "merge").mkdir(parents=True)
        os.symlink(tmp_path / "theirs", staging / "merge" / "tokenizer")
    else:
        os.symlink(tmp_path / "theirs", staging)
    user = user_tree(previous)
    staged_merge(str(previous), writer({**OLD, "config.json": "new config"}))
    assert user_tree(previous) == user
    assert (tmp_path / "theirs" / "precious.txt").read_text() == "precious"
    assert (previous / "config.json").read_text() == "new config"
    assert ours_left(previous) == []


@pytest.mark.parametrize("what", ["a link", "a file"])
def test_our_folder_not_as_we_make_it_is_refused(previous, tmp_path, what):
    """Its staging is removed: never through a link to the user's folder."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "staged").mkdir()
    shutil.rmtree(previous / STATE)
    if what == "a link":
        os.symlink(tmp_path / "elsewhere", previous / STATE)
    else:
        (previous / STATE).write_text("not ours")
    before, elsewhere = tree(previous), tree(tmp_path / "elsewhere")
    with pytest.raises(OutputError, match="which mergekit-ram did not make"):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == before and tree(tmp_path / "elsewhere") == elsewhere


@pytest.mark.parametrize(
    "out, message",
    [
        ("", "folder path is empty"),
        ("dangling", r"cannot be resolved \(No such file or directory"),
        ("file/out", "which is a file"),
        ("loop/x/out", r"cannot be resolved \(Too many levels of symbolic links"),
        ("file", "is a file, not a folder"),
    ],
)
def test_unpublishable_paths_are_refused_before_anything(
    tmp_path, monkeypatch, out, message
):
    """An empty OUT (an unset "$OUTDIR") never means the current folder."""
    (tmp_path / "file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    monkeypatch.chdir(tmp_path)
    before, called = tree(tmp_path), []
    with pytest.raises(OutputError, match=message):
        staged_merge(out, called.append)
    assert not called and tree(tmp_path) == before


# --- the OS refusing a step: one error that says where OUT stands ------------------


def ends(suffix: str):
    """when(*args) of raise_on: the step's (last) path ends with suffix."""
    return lambda *args: str(args[-1]).endswith(suffix)


def second_manifest():
    seen = []  # the manifest written after the renames
    manifest = ends(os.sep + MANIFEST)
    return lambda *a: manifest(*a) and seen.append(a) or len(seen) > 1


@pytest.mark.parametrize(
    "name, code, when, state",
    [
        ("replace", errno.EPERM, ends(os.sep + MANIFEST), "old"),
        ("replace", errno.ENOSPC, ends(os.sep + MANIFEST), "old"),
        ("fsync", errno.EIO, lambda *a: True, "old"),
        ("unlink", errno.EPERM, ends(f"out{os.sep}config.json"), "old"),
        ("replace", errno.EPERM, ends("model.safetensors"), "half"),
        ("replace", errno.ENOSPC, second_manifest(), "new"),
    ],
    ids=["manifest EPERM", "manifest full", "fsync EIO", "immutable", "a move", "end"],
)
def test_a_step_the_os_refuses_says_where_out_stands(
    previous, tmp_path, monkeypatch, name, code, when, state
):
    """The OS refusing the manifest (EPERM for EROFS / EIO), a full disk
    there, OUT made immutable right after it, a rename refused: one
    OutputError that truly says where OUT stands; the next run publishes."""
    error = OSError(code, os.strerror(code))
    raise_on(monkeypatch, output_folder.os, name, error, when)
    with pytest.raises(OutputError, match=f"{os.strerror(code)}.*{SAID[state]}"):
        staged_merge(str(previous), writer(NEW))
    monkeypatch.undo()
    states = {
        "old": expected(OLD, tmp_path / "old"),
        "new": expected(NEW, tmp_path / "new"),
    }
    assert settled(tree(previous), states) == state
    staged_merge(str(previous), writer(NEWER))
    assert tree(previous) == expected(NEWER, tmp_path / "newer")
    assert ours_left(previous) == []
