"""mergekit_ram.integration.output_folder: lock, staging, journal, publish, recovery.

The protocol alone, with a stand-in for mergekit that writes a few files; the
whole merges that exercise it are in test_integration_publishing*.py. OUT is
always a user's folder here: notes, a `.git`, a symlink, a read-only file. The
fault-injection test interrupts a real child process at every file-system
step (SIGKILL, SIGTERM, SIGINT, SIGHUP) and then runs a next merge that fails
and one that succeeds. Mounts and other users are real where this machine
allows them (root), skipped with the reason elsewhere.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from faults import (
    EXITS,
    MANIFEST,
    SIGNALS,
    STATE,
    check_exit,
    ours_left,
    run_interrupted,
)

import mergekit_ram.integration.output_folder as output_folder
from mergekit_ram.integration.output_folder import (
    JOURNAL,
    Journal,
    OutputError,
    locked,
    resolve_output,
    staged_merge,
)


def tree(folder: Path) -> dict[str, str]:
    """Every entry under folder but our own: sha256 of files, link targets,
    'dir' (with a read-only mark), never following a link."""
    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if name.split(os.sep)[0] == STATE:
            continue
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[name] = "dir"
        else:
            mode = "ro " if not os.stat(path).st_mode & stat.S_IWUSR else ""
            found[name] = mode + hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def writer(files: dict[str, str]):
    def write(staged: str) -> None:
        for name, text in files.items():
            Path(staged, name).write_text(text)

    return write


def failing(staged: str) -> None:
    Path(staged, "model-1.safetensors").write_text("partial")
    raise RuntimeError("a NaN in a task model")


OLD = {
    "config.json": "old config",
    "mergekit_config.yml": "old recipe",
    "model-00001-of-00002.safetensors": "old shard 1",
    "model-00002-of-00002.safetensors": "old shard 2",
    "model.safetensors.index.json": "old index",
    "README.md": "old card",
    "tokenizer.json": "old tokenizer",
}
NEW = {
    "config.json": "new config",
    "mergekit_config.yml": "new recipe",
    "model.safetensors": "new weights",
    "README.md": "new card",
}
NEWER = {**NEW, "model.safetensors": "newer weights"}
USER = ("notes.txt", "eval", "latest", ".git", "frozen.txt")


def with_user_files(out: Path) -> None:
    """What a user keeps next to a model: notes, results, a link, a git
    clone's `.git`, a file only they may write."""
    (out / "notes.txt").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "scores.csv").write_text("1,2")
    os.symlink("notes.txt", out / "latest")
    (out / ".git" / "objects" / "ab").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (out / ".git" / "objects" / "ab" / "cdef").write_bytes(b"\x78\x01blob")
    (out / "frozen.txt").write_text("read-only")
    (out / "frozen.txt").chmod(0o444)


def user_tree(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree(out).items() if k.split(os.sep)[0] in USER}


def expected(files: dict[str, str], root: Path) -> dict[str, str]:
    """tree() of a folder holding exactly `files` and the user's files."""
    root.mkdir()
    writer(files)(str(root))
    with_user_files(root)
    return tree(root)


@pytest.fixture
def previous(tmp_path) -> Path:
    """OUT holding the user's files and a previous (sharded) merge we published."""
    out = tmp_path / "out"
    out.mkdir()
    with_user_files(out)
    staged_merge(str(out), writer(OLD))
    return out


def manifest(out: Path) -> dict:
    return json.loads((out / STATE / MANIFEST).read_text())["files"]


# --- publishing -------------------------------------------------------------------


def test_publish_replaces_the_old_merge_and_keeps_user_files(previous, tmp_path):
    """Item 10: the old merge's shards, index and tokenizer go; the user's
    files, `.git` included, stay byte for byte; only the manifest is left."""
    user = user_tree(previous)
    staged_merge(str(previous), writer(NEW))
    assert tree(previous) == expected(NEW, tmp_path / "want")
    assert user_tree(previous) == user
    assert set(manifest(previous)) == set(NEW)
    assert ours_left(previous) == []
    assert sorted(os.listdir(previous / STATE)) == [".gitignore", MANIFEST]


def test_a_git_clone_commits_none_of_our_state(previous):
    """OUT is often a clone of the model's hub repository: `git add -A`
    takes the merge and leaves our folder out."""
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


def test_a_file_the_user_changed_since_the_merge_wrote_it_is_kept(previous):
    (previous / "tokenizer.json").write_text("my own tokenizer now")
    staged_merge(str(previous), writer(NEW))
    assert (previous / "tokenizer.json").read_text() == "my own tokenizer now"


def test_a_folder_stock_mergekit_wrote_loses_only_its_weights(tmp_path):
    """No manifest: mergekit's own output names are the old merge's."""
    out = tmp_path / "out"
    out.mkdir()
    writer(OLD)(str(out))
    with_user_files(out)
    staged_merge(str(out), writer(NEW))
    want = expected({**NEW, "tokenizer.json": OLD["tokenizer.json"]}, tmp_path / "w")
    assert tree(out) == want  # a tokenizer may be the user's: it stays


def test_a_new_folder_with_missing_parents(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    staged_merge(str(out), writer(NEW))
    assert {k: v for k, v in tree(out).items()} == {
        k: hashlib.sha256(v.encode()).hexdigest() for k, v in NEW.items()
    }
    assert ours_left(out) == []


@pytest.mark.parametrize("where", ["new", "empty", "parents"])
def test_a_failed_merge_leaves_no_folder_it_made(tmp_path, where):
    out = tmp_path / ("out" if where != "parents" else "a/b/out")
    if where == "empty":
        out.mkdir()
    with pytest.raises(RuntimeError):
        staged_merge(str(out), failing)
    if where == "empty":  # the user's folder stays, empty as it was
        assert os.listdir(out) == []
    else:
        assert os.listdir(tmp_path) == []


def test_a_failed_merge_leaves_the_previous_one_and_the_manifest(previous):
    before, recorded = tree(previous), manifest(previous)
    with pytest.raises(RuntimeError):
        staged_merge(str(previous), failing)
    assert tree(previous) == before and manifest(previous) == recorded
    assert ours_left(previous) == []


def test_long_and_odd_names(previous, tmp_path):
    out = tmp_path / ("m é$ 'x\"" + "m" * 230)
    previous.rename(out)
    user = user_tree(out)
    staged_merge(str(out), writer(NEW))
    assert user_tree(out) == user and (out / "config.json").read_text() == "new config"
    assert ours_left(out) == []


def test_symlinked_out_publishes_into_its_target(previous, tmp_path):
    os.symlink(previous, tmp_path / "link")
    staged_merge(str(tmp_path / "link"), writer(NEW))
    assert (tmp_path / "link").is_symlink()
    assert (previous / "model.safetensors").read_text() == "new weights"
    assert not (previous / "model-00001-of-00002.safetensors").exists()


def test_a_folder_where_the_merge_writes_a_file_is_refused(previous):
    (previous / "README.md").unlink()
    (previous / "README.md").mkdir()
    (previous / "README.md" / "mine.txt").write_text("mine")
    before = tree(previous)
    with pytest.raises(OutputError, match="holds a folder named README.md"):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == before and ours_left(previous) == []


def test_foreign_weights_in_out_are_refused(tmp_path):
    (tmp_path / "model.safetensors").write_text("someone's model")
    with pytest.raises(OutputError, match="no mergekit_config.yml"):
        staged_merge(str(tmp_path), writer(NEW))
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_full_disk_is_one_message_and_out_intact(previous):
    before = tree(previous)

    def full(staged: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), staged + "/x")

    with pytest.raises(OutputError, match="The disk is full"):
        staged_merge(str(previous), full)
    assert tree(previous) == before and ours_left(previous) == []


def test_sigterm_and_sighup_handlers_are_restored(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    staged_merge(str(tmp_path / "out"), writer(NEW))
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_changed_file_is_never_replaced_while_publishing(
    previous, caplog, monkeypatch
):
    """Someone rewrites a file the merge replaces between the plan and the
    move (a writer in OUT): theirs stays, a warning says so."""
    real_plan = output_folder.OutputState.plan

    def plan_then_edit(self, staged):
        journal = real_plan(self, staged)
        (previous / "README.md").write_text("written meanwhile, longer")
        return journal

    monkeypatch.setattr(output_folder.OutputState, "plan", plan_then_edit)
    staged_merge(str(previous), writer(NEW))
    assert (previous / "README.md").read_text() == "written meanwhile, longer"
    assert (previous / "config.json").read_text() == "new config"
    assert "Kept README.md" in caplog.text
    assert "README.md" not in manifest(previous)


# --- paths that are refused before anything ----------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: None, "folder path is empty"),
        (lambda t: os.symlink(t / "nowhere", t / "out"), "symlink to nothing"),
        (lambda t: (t / "file").write_text("x"), "which is a file"),
        (lambda t: os.symlink(t / "loop", t / "loop"), "symlink loop"),
        (lambda t: (t / "out").write_text("x"), "is a file, not a folder"),
    ],
    ids=["empty", "dangling symlink", "parent is a file", "symlink loop", "a file"],
)
def test_unpublishable_paths_are_refused_before_anything(
    tmp_path, monkeypatch, make, message
):
    """Item 7: an empty OUT (an unset "$OUTDIR") never means the current folder."""
    make(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = {
        "folder path is empty": "",
        "symlink to nothing": "out",
        "which is a file": "file/out",
        "symlink loop": "loop/x/out",
        "is a file, not a folder": "out",
    }[message]
    before = tree(tmp_path)
    called = []
    with pytest.raises(OutputError, match=message):
        staged_merge(out, lambda staged: called.append(staged))
    assert not called and tree(tmp_path) == before


# --- the lock --------------------------------------------------------------------


def test_one_lock_for_every_spelling(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    spellings = ["real", "./real", str(tmp_path / "real"), "link", "link/../real"]
    assert {resolve_output(s) for s in spellings} == {str(tmp_path / "real")}
    with locked(resolve_output("link")):
        for spelled in spellings:
            with pytest.raises(OutputError, match="Another merge"):
                staged_merge(spelled, writer(NEW))
    assert os.listdir(tmp_path / "real") == []  # lock and folder gone again


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_our_folder_replaced_by_a_link_or_a_file_is_refused(previous, tmp_path, kind):
    shutil.rmtree(previous / STATE)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "theirs.txt").write_text("theirs")
    if kind == "symlink":
        os.symlink(tmp_path / "elsewhere", previous / STATE)
    else:
        (previous / STATE).write_text("not ours")
    before, elsewhere = tree(previous), tree(tmp_path / "elsewhere")
    shown = {"symlink": "link", "file": "file"}[kind]
    with pytest.raises(OutputError, match=f"which is a {shown}"):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == before and tree(tmp_path / "elsewhere") == elsewhere


def test_a_lock_file_replaced_by_a_link_is_refused(previous, tmp_path):
    (tmp_path / "theirs").write_text("theirs")
    os.symlink(tmp_path / "theirs", previous / STATE / "lock")
    with pytest.raises(OutputError, match="which is a link"):
        staged_merge(str(previous), writer(NEW))
    assert (tmp_path / "theirs").read_text() == "theirs"
    (previous / STATE / "lock").unlink()
    os.mkfifo(previous / STATE / "lock")  # opening it to lock would block
    with pytest.raises(OutputError, match=r"which is a special file \(a FIFO"):
        staged_merge(str(previous), writer(NEW))


# --- our state from a clone or a copy: untrusted -----------------------------------


def hostile_manifests(out: Path) -> dict[str, object]:
    notes = os.lstat(out / "notes.txt")
    wrong = ["file", notes.st_size, notes.st_mtime_ns + 1]
    files = {"notes.txt": wrong, "eval": ["folder", 4096, 0], ".git": wrong}
    return {
        "names the user's files": {"files": files},
        "leads elsewhere": {
            "files": {
                "../outside.txt": wrong,
                "/etc/hostname": wrong,
                "eval/scores.csv": wrong,
                "..": wrong,
                STATE: wrong,
            }
        },
        "malformed": {"files": {"notes.txt": "everything", "x": [1, 2]}},
        "not a dict": {"files": ["notes.txt"]},
    }


@pytest.mark.parametrize(
    "hostile",
    [
        "names the user's files",
        "leads elsewhere",
        "malformed",
        "not a dict",
        "garbage",
        "nested too deep",
        "a symlink",
        "huge",
    ],
)
def test_a_hostile_manifest_costs_no_user_file(previous, tmp_path, hostile):
    (tmp_path / "outside.txt").write_text("outside")
    path = previous / STATE / MANIFEST
    path.unlink()
    documents = hostile_manifests(previous)
    if hostile in documents:
        document = {"format": output_folder.FORMAT, "version": 1}
        path.write_text(json.dumps({**document, **documents[hostile]}))
    elif hostile == "garbage":
        path.write_bytes(b"\x00{not json")
    elif hostile == "nested too deep":  # json's parser recurses
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif hostile == "a symlink":
        (tmp_path / "theirs.json").write_text(json.dumps({"files": {}}))
        os.symlink(tmp_path / "theirs.json", path)
    else:
        with open(path, "wb") as handle:
            handle.truncate(output_folder.STATE_LIMIT + 1)
    user = user_tree(previous)
    staged_merge(str(previous), writer(NEW))
    assert user_tree(previous) == user
    assert (tmp_path / "outside.txt").read_text() == "outside"
    assert (previous / "config.json").read_text() == "new config"
    assert ours_left(previous) == []


@pytest.mark.parametrize(
    "journal", ['{"format": "something else"}', "[" * 100_000 + "]" * 100_000]
)
def test_a_journal_that_is_not_ours_is_refused_and_nothing_changes(previous, journal):
    (previous / STATE / JOURNAL).write_text(journal)
    before = tree(previous)
    with pytest.raises(OutputError, match="not a publishing journal"):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == before
    (previous / STATE / JOURNAL).unlink()  # the fix the message names
    staged_merge(str(previous), writer(NEW))
    assert (previous / "config.json").read_text() == "new config"


def test_a_copied_journal_never_replaces_a_file_that_changed(previous):
    """A journal (from a copy) naming the user's file as a move or a removal:
    the file is not what the journal recorded, so it stays."""
    notes = os.lstat(previous / "notes.txt")
    staged = previous / STATE / "staged" / "out"
    staged.mkdir(parents=True)
    (staged / "notes.txt").write_text("the journal's")
    found = os.lstat(staged / "notes.txt")
    recorded = ("file", notes.st_size + 1, notes.st_mtime_ns)
    journal = Journal(
        "out",
        moves=(("notes.txt", recorded),),
        removals=(("frozen.txt", recorded),),
        manifest={"notes.txt": ("file", found.st_size, found.st_mtime_ns)},
    )
    (previous / STATE / JOURNAL).write_text(json.dumps(journal.document()))
    user = user_tree(previous)
    staged_merge(str(previous), writer(NEW))
    assert user_tree(previous) == user
    assert ours_left(previous) == []


def test_staging_that_is_a_link_is_removed_not_followed(previous, tmp_path):
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "precious.txt").write_text("precious")
    os.symlink(tmp_path / "theirs", previous / STATE / "staged")
    staged_merge(str(previous), writer(NEW))
    assert (tmp_path / "theirs" / "precious.txt").read_text() == "precious"
    assert ours_left(previous) == []


@pytest.mark.parametrize("link", ["staged", "folder"])
def test_a_journal_over_linked_staging_moves_nothing_in(previous, tmp_path, link):
    """A clone shipping `.mergekit-ram/journal.json` and a staging link to the
    user's home: finishing that journal would move the user's key into OUT.
    Refused before anything moves; the fix the message names works."""
    home = tmp_path / "home" / ".ssh"
    home.mkdir(parents=True)
    (home / "id_rsa").write_text("secret")
    found = os.lstat(home / "id_rsa")
    identity = ("file", found.st_size, found.st_mtime_ns)
    if link == "staged":
        os.symlink(home.parent, previous / STATE / "staged")
    else:
        (previous / STATE / "staged").mkdir()
        os.symlink(home, previous / STATE / "staged" / ".ssh")
    journal = Journal(".ssh", (("id_rsa", None),), (), {"id_rsa": identity})
    (previous / STATE / JOURNAL).write_text(json.dumps(journal.document()))
    before = tree(previous)
    with pytest.raises(OutputError, match="is a link, not a folder"):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == before
    (previous / STATE / JOURNAL).unlink()
    staged_merge(str(previous), writer(NEW))
    assert (home / "id_rsa").read_text() == "secret"
    assert not (previous / "id_rsa").exists()
    assert ours_left(previous) == []


@pytest.mark.skipif(not output_folder.PINNED, reason="no folder descriptors here")
def test_a_link_swapped_in_after_a_check_is_never_walked(tmp_path, monkeypatch):
    """Another process swaps a staging folder for a link to the user's files
    right after the walk looked at it: the walk goes on in the folder it
    opened, and removes the link as a link."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "private.txt").write_text("theirs")
    staging = tmp_path / "staged"
    (staging / "x").mkdir(parents=True)
    (staging / "x" / "ours.bin").write_text("ours")
    real_fstat = os.fstat
    swapped = []
    inner = os.lstat(staging / "x").st_ino

    def swap_after_the_check(descriptor):
        found = real_fstat(descriptor)
        if not swapped and found.st_ino == inner:  # x is open: swap it now
            os.rename(staging / "x", tmp_path / "moved-away")
            os.symlink(victim, staging / "x")
            swapped.append(True)
        return found

    monkeypatch.setattr(output_folder.os, "fstat", swap_after_the_check)
    output_folder._remove_tree(str(staging), os.lstat(staging).st_dev)
    assert swapped and (victim / "private.txt").read_text() == "theirs"
    assert not staging.exists()
    assert not (tmp_path / "moved-away" / "ours.bin").exists()  # walked as opened


def test_another_users_state_folder_is_refused(previous, monkeypatch):
    """Whoever owns OUT/.mergekit-ram could swap what a merge stages there;
    the fix named depends on whether that user's publish is unfinished."""
    monkeypatch.setattr(output_folder.os, "geteuid", lambda: os.getuid() + 4242)
    before = tree(previous)
    with pytest.raises(OutputError, match="belongs to another user") as refused:
        staged_merge(str(previous), writer(NEW))
    assert "remove that folder" in str(refused.value)
    assert tree(previous) == before
    (previous / STATE / JOURNAL).write_text("{}")
    with pytest.raises(OutputError, match="belongs to another user") as refused:
        staged_merge(str(previous), writer(NEW))
    assert "finishes the publish" in str(refused.value)
    assert "remove that folder" not in str(refused.value)


def test_staging_nested_deeper_than_any_merge_is_one_error(previous):
    deep, depth, here = previous / STATE / "staged", 1200, os.getcwd()
    deep.mkdir()
    os.chdir(deep)  # built and removed relative: a whole path this deep is too long
    try:
        for _ in range(depth):
            os.mkdir("d")
            os.chdir("d")
        os.chdir(here)
        with pytest.raises(OutputError, match="nested deeper than any merge"):
            staged_merge(str(previous), writer(NEW))
        assert (previous / "config.json").read_text() != "new config"
        os.chdir(deep)
        for _ in range(depth):
            os.chdir("d")
        for _ in range(depth):
            os.chdir("..")
            os.rmdir("d")
    finally:
        os.chdir(here)


@pytest.mark.parametrize("planted", ["config.json", "extra.txt", "no staging"])
def test_a_journal_whose_staging_is_not_what_it_recorded_is_refused(previous, planted):
    """A journal (from a `cp -r` or a clone) whose staged file is not the one
    it recorded, or whose staging is gone: finishing it would publish a mix
    (new weights beside the old config.json), so it is refused before
    anything moves."""
    staged = previous / STATE / "staged" / "out"
    staged.mkdir(parents=True)
    for name in ("config.json", "extra.txt"):
        (staged / name).write_text(f"staged {name}")
    manifest = {
        name: ("file", found.st_size, found.st_mtime_ns)
        for name in ("config.json", "extra.txt")
        for found in [os.lstat(staged / name)]
    }
    if planted == "no staging":
        shutil.rmtree(previous / STATE / "staged")
        match = "is missing"
    else:
        manifest[planted] = ("file", 1, 1)
        match = f"its staged {planted} is not the file it recorded"
    journal = Journal(
        "out",
        moves=(("config.json", None), ("extra.txt", None)),
        removals=tuple((n, i) for n, i in manifest_of(previous).items()),
        manifest=manifest,
    )
    (previous / STATE / JOURNAL).write_text(json.dumps(journal.document()))
    before = tree(previous)
    with pytest.raises(OutputError, match=match):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == before
    (previous / STATE / JOURNAL).unlink()
    staged_merge(str(previous), writer(NEW))
    assert not (previous / "extra.txt").exists()
    assert (previous / "config.json").read_text() == "new config"
    assert ours_left(previous) == []


def manifest_of(out: Path) -> dict:
    """The manifest's records as identities (tuples)."""
    return {name: tuple(value) for name, value in manifest(out).items()}


# --- the user's folder stays theirs -----------------------------------------------

COUNTING = """
import importlib.util, os, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("output_folder", sys.argv[1])
folder = sys.modules["output_folder"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(folder)
calls = []
class Counting:
    def __getattr__(self, name):
        real = getattr(os, name)
        if not callable(real):
            return real
        def counted(*a, **k):
            calls.append(name)
            return real(*a, **k)
        return counted
folder.os = Counting()
def write(staged):
    for name in ("config.json", "model.safetensors", "README.md"):
        Path(staged, name).write_text(name)
folder.staged_merge(sys.argv[2], write)
print(len(calls))
"""


def clone_like(out: Path, files: int) -> None:
    """A git clone's shape: `.git/objects/xx/...` and a worktree of files."""
    for i in range(files):
        folder = out / ".git" / "objects" / f"{i % 256:02x}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:038x}").write_bytes(b"x" * (i % 7))
    (out / "docs").mkdir()
    for i in range(files // 10):
        (out / "docs" / f"page{i}.md").write_text(str(i))


def test_a_git_clone_is_untouched_and_costs_the_publish_nothing(tmp_path):
    """Item 2/3's cause: the publish never walks OUT. The same number of
    file-system calls with 2,200 user files as with none (and a measured
    time in benchmarks/publish.py)."""
    counts = {}
    for files in (0, 2000):
        out = tmp_path / f"out{files}"
        out.mkdir()
        clone_like(out, files)
        before = tree(out)
        for _ in range(2):  # a first merge, then one over it
            done = subprocess.run(
                [sys.executable, "-c", COUNTING, output_folder.__file__, str(out)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
        counts[files] = int(done.stdout)
        after = tree(out)
        assert {k: after[k] for k in before} == before
        assert set(after) - set(before) == {
            "config.json",
            "model.safetensors",
            "README.md",
        }
    assert counts[0] == counts[2000]


WRITER = """
import os, sys, time
out, stop = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(out, "logs"), exist_ok=True)
n = 0
while not os.path.exists(stop):
    with open(os.path.join(out, "logs", f"{n}.txt"), "w") as handle:
        handle.write(str(n))
    n += 1
    time.sleep(0.002)
print(n)
"""


def test_files_written_into_out_during_the_merge_and_publish_survive(
    previous, tmp_path
):
    """Item 3: another program writes OUT/logs/N.txt every 2 ms throughout."""
    stop = tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(previous), str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for files in (NEW, NEWER, NEW):

            def slow(staged: str, files=files) -> None:
                time.sleep(0.1)
                writer(files)(staged)

            staged_merge(str(previous), slow)
    finally:
        stop.touch()
        written = int(proc.communicate(timeout=60)[0])
    logs = sorted(os.listdir(previous / "logs"), key=lambda n: int(n.split(".")[0]))
    assert written > 20 and logs == [f"{n}.txt" for n in range(written)]
    assert all((previous / "logs" / n).read_text() == n[:-4] for n in logs)


NESTED = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("output_folder", sys.argv[1])
folder = sys.modules["output_folder"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(folder)
def write(staged):
    print("WRITING", flush=True)
    time.sleep(float(sys.argv[3]))
    for name in ("config.json", "model.safetensors"):
        Path(staged, name).write_text(sys.argv[2] + name)
folder.staged_merge(sys.argv[2], write)
"""


def test_nested_merges_at_once_both_publish(tmp_path):
    """Item 4: a merge into a/b and one into a/b/c at the same time."""
    outer, inner = tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"

    def start(out: Path, pause: float) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                NESTED,
                output_folder.__file__,
                str(out),
                str(pause),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = start(outer, 1.0)
    assert first.stdout.readline().strip() == "WRITING"
    second = start(inner, 0.0)
    for proc in (second, first):
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    for out in (outer, inner):
        assert (out / "config.json").read_text() == f"{out}config.json"
        assert ours_left(out) == []
    assert sorted(os.listdir(outer)) == [STATE, "c", "config.json", "model.safetensors"]


# --- interrupting a real process at every file-system step --------------------


def run_protocol(folder: Path, out: Path, step: int, how: str, **kwargs):
    files = ";".join(f"{k}={v}" for k, v in NEW.items())
    args = [output_folder.__file__, str(out), files]
    return run_interrupted(folder, step, how, "protocol", args, **kwargs)


def make_out(root: Path, scenario: str) -> Path:
    root.mkdir(parents=True)
    out = root / "out"
    if scenario == "previous merge":
        out.mkdir()
        with_user_files(out)
        staged_merge(str(out), writer(OLD))
    return out


@pytest.fixture
def memory_tmp(tmp_path):
    """A folder on tmpfs where there is one (fsync is free there, the protocol
    the same), else tmp_path: hundreds of publishes stay fast."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="mergekit-ram-test-", dir="/dev/shm"))
    yield folder
    for path in folder.rglob("*"):  # the user's read-only file
        if not path.is_symlink():
            path.chmod(0o755)
    shutil.rmtree(folder)


def settled(state: dict | None, states: dict) -> str:
    """Which state OUT is in: old, new, or (between a kill and the next run
    only) half-published with no config.json, so it does not load as a model."""
    name = next((k for k, v in states.items() if v == state), None)
    if name is not None:
        return name
    assert state is not None and "config.json" not in state, state
    assert {k: v for k, v in state.items() if k.split(os.sep)[0] in USER} == {
        k: v for k, v in states["new"].items() if k.split(os.sep)[0] in USER
    }
    return "half"


@pytest.mark.parametrize(
    "scenario",
    ["previous merge", pytest.param("new folder", marks=pytest.mark.slow)],
)
def test_interrupted_at_every_step_then_next_runs(memory_tmp, scenario):
    """Item 1/8: after SIGKILL, SIGTERM, SIGINT or SIGHUP at any file-system
    step, OUT is exactly old or exactly new with every user file, or (after
    SIGKILL only, until the next run) a folder without config.json; a held
    signal exits 128 + its number with one line saying which; the next run
    that fails leaves old or new, one that succeeds publishes; nothing of
    ours is left."""
    tmp_path = memory_tmp
    code, output, steps = run_protocol(
        tmp_path, make_out(tmp_path / "count", scenario), 0, "SIGKILL"
    )
    assert code == 0, output
    assert steps >= (30 if scenario == "previous merge" else 10)
    states: dict = {}
    if scenario == "previous merge":
        states["old"] = expected(OLD, tmp_path / "old")
        states["new"] = expected(NEW, tmp_path / "new")
        states["newer"] = expected(NEWER, tmp_path / "newer")
    else:
        states["old"] = None
        for label, files in (("new", NEW), ("newer", NEWER)):
            (tmp_path / label).mkdir()
            writer(files)(str(tmp_path / label))
            states[label] = tree(tmp_path / label)
    seen, outcomes = set(), set()
    for step in range(1, steps + 1):
        for how in SIGNALS:
            root = tmp_path / f"{step}-{how}"
            out = make_out(root, scenario)
            code, output, _ = run_protocol(tmp_path, out, step, how)
            assert code in EXITS[how], (step, how, output)
            state = settled(tree(out) if out.exists() else None, states)
            seen.add(state)
            if how != "SIGKILL":
                outcomes.add(check_exit(how, code, state, output))
                assert ours_left(out) == [], (step, how, output)
            with pytest.raises(RuntimeError):
                staged_merge(str(out), failing)
            state = tree(out) if out.exists() else None
            if state == {} and scenario == "new folder":
                state = None  # killed between making OUT and our folder in it
            assert state in (states["old"], states["new"]), (step, how, output)
            assert ours_left(out) == [], (step, how)
            staged_merge(str(out), writer(NEWER))
            assert tree(out) == states["newer"], (step, how)
            assert ours_left(out) == [], (step, how)
    assert seen == {"old", "new", "half"}
    # Each signal held while publishing, and before the merge (Ctrl-C is then
    # Python's KeyboardInterrupt, the others exit 128 + their number).
    wanted = {(how, "held", "new") for how in SIGNALS[1:]}
    wanted |= {("SIGTERM", "held", "old"), ("SIGHUP", "held", "old")}
    wanted |= {("SIGINT", "interrupted", "old")}
    assert wanted <= outcomes, outcomes


def killed_after_the_journal(folder: Path) -> Path:
    """OUT as SIGKILL at the first step after the journal was made durable
    leaves it: config.json gone, the rest of the publish still to do."""
    for step in range(1, 100):
        out = make_out(folder / f"killed-{step}", "previous merge")
        run_protocol(folder, out, step, "SIGKILL")
        if not (out / "config.json").exists():
            assert (out / STATE / JOURNAL).exists()
            return out
    raise AssertionError("no step removed config.json")


def test_a_killed_publish_then_another_program_writes_into_out(memory_tmp):
    """Item 1: killed mid-publish, then `mkdir -p OUT`, stock mergekit or
    `analyze --out OUT` add files; a next run on another host (a new
    container) finishes the publish and keeps every one of them."""
    out = killed_after_the_journal(memory_tmp)
    os.makedirs(out, exist_ok=True)
    (out / "report.json").write_text("{}")
    (out / "report.md").write_text("the user's report")
    user = user_tree(out)
    code, output, _ = run_protocol(
        memory_tmp, out, 0, "SIGKILL", env={"FAULT_HOSTNAME": "another-container"}
    )
    assert code == 0, output
    assert user_tree(out) == user
    assert (out / "report.md").read_text() == "the user's report"
    assert (out / "config.json").read_text() == NEW["config.json"]
    assert ours_left(out) == []


# --- real mounts (tmpfs) and other users, where this machine allows them ----------


@pytest.fixture
def tmpfs(tmp_path):
    """mount(point, size, read_only) -> a fresh tmpfs at point; all unmounted after."""
    mounted: list[Path] = []

    def mount(point: Path, size: str = "4m", read_only: bool = False) -> Path:
        point.mkdir(parents=True, exist_ok=True)
        options = f"size={size}" + (",ro" if read_only else "")
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", str(point)], check=True)


def test_a_mount_point_out_publishes(tmpfs, tmp_path):
    """Item 9: a Docker volume is a mount point; stock mergekit writes there."""
    out = tmpfs(tmp_path / "volume")
    with_user_files(out)
    user = user_tree(out)
    staged_merge(str(out), writer(NEW))
    staged_merge(str(out), writer(NEWER))
    assert user_tree(out) == user and (out / "model.safetensors").read_text() == (
        "newer weights"
    )
    assert ours_left(out) == []


def test_a_mount_below_out_is_untouched(tmpfs, previous):
    """Item 2: OUT/data/disk keeps its files, and unmounts afterwards."""
    disk = tmpfs(previous / "data" / "disk")
    (disk / "dataset.jsonl").write_text("rows")
    before = tree(previous)
    staged_merge(str(previous), writer(NEW))
    after = tree(previous)
    assert {k: after[k] for k in before if k.startswith("data")} == {
        k: v for k, v in before.items() if k.startswith("data")
    }
    assert ours_left(previous) == []


def test_a_mount_inside_our_staging_is_left_alone_and_named(tmpfs, previous):
    """A disk mounted inside a killed run's staging is never walked into;
    the message names its whole path."""
    disk = tmpfs(previous / STATE / "staged" / "out" / "deeper")
    (disk / "dataset.jsonl").write_text("rows")
    with pytest.raises(OutputError, match=f"{disk} is a mount point inside"):
        staged_merge(str(previous), writer(NEW))
    assert (disk / "dataset.jsonl").read_text() == "rows"


def test_one_folder_under_two_paths_has_one_lock(tmpfs, previous, tmp_path):
    """Item 5: a bind mount shows OUT under a second path."""
    tmpfs(tmp_path / "probe")  # skips where mounting is not permitted
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["mount", "--bind", str(previous), str(other)], check=True)
    try:
        with locked(resolve_output(str(previous))):
            with pytest.raises(OutputError, match="Another merge"):
                staged_merge(str(other), writer(NEW))
        staged_merge(str(other), writer(NEW))
        assert (previous / "config.json").read_text() == "new config"
    finally:
        subprocess.run(["umount", str(other)], check=True)


def test_tmpfs_read_only_and_full(tmpfs, tmp_path):
    read_only = tmpfs(tmp_path / "ro", read_only=True)
    with pytest.raises(OutputError, match="cannot be created"):
        staged_merge(str(read_only / "out"), writer(NEW))
    small = tmpfs(tmp_path / "small", size="64k")
    out = small / "out"
    out.mkdir()
    staged_merge(str(out), writer(OLD))
    before = tree(out)

    def huge(staged: str) -> None:
        Path(staged, "model.safetensors").write_bytes(b"\0" * 1_000_000)

    def huge_tensors(staged: str) -> None:
        """mergekit's writer: safetensors says a full disk in words only."""
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(250_000)}, str(Path(staged, "model.safetensors")))

    for write in (huge, huge_tensors):
        with pytest.raises(OutputError, match="The disk is full"):
            staged_merge(str(out), write)
        assert tree(out) == before and ours_left(out) == []


@pytest.fixture
def nobody(tmp_path):
    """run(out) -> a protocol run as the user `nobody`, in a folder it can reach."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as another user")
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no user `nobody`")
    prefix = (
        "setpriv",
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
    )
    import filelock

    path = [str(Path(output_folder.__file__).parents[2])]
    path.append(str(Path(filelock.__file__).parents[1]))
    env = {"PYTHONPATH": os.pathsep.join(path)}
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    probe = "import filelock, mergekit_ram.integration.output_folder"
    for python in (sys.executable, f"/usr/bin/{minor}"):
        done = subprocess.run(
            [*prefix, python, "-c", probe],
            env={**os.environ, **env},
            capture_output=True,
        )
        if done.returncode == 0:
            break
    else:
        pytest.skip("no Python and package here that `nobody` may run")
    root = Path(tempfile.mkdtemp(prefix="mergekit-ram-nobody-"))
    root.chmod(0o755)

    def run(out: Path) -> tuple[int, str]:
        code, output, _ = run_protocol(
            root, out, 0, "SIGKILL", env=env, prefix=prefix, python=python
        )
        return code, output

    yield root, user, run
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755)
    shutil.rmtree(root)


def test_as_another_user_read_only_subfolder_and_unwritable_parent(nobody):
    """Items 6 and 9: OUT of nobody's with a read-only subfolder, in a folder
    nobody may not write."""
    root, user, run = nobody
    parent = root / "readonly-parent"
    out = parent / "out"
    out.mkdir(parents=True)
    (out / "results").mkdir()
    (out / "results" / "run1.txt").write_text("kept")
    for path in (out, out / "results", out / "results" / "run1.txt"):
        os.chown(path, user.pw_uid, user.pw_gid)
    (out / "results").chmod(0o555)
    parent.chmod(0o555)
    before = tree(out)
    for _ in range(2):
        code, output = run(out)
        assert code == 0, output
    after = tree(out)
    assert {k: after[k] for k in before} == before
    assert (out / "config.json").read_text() == NEW["config.json"]
    assert ours_left(out) == []


def test_as_another_user_a_shared_folder_in_a_sticky_one(nobody):
    """Item 9: a root-owned, world-writable OUT in a sticky folder (/tmp)."""
    root, _user, run = nobody
    sticky = root / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    out = sticky / "out"
    out.mkdir()
    out.chmod(0o777)
    (out / "root-notes.txt").write_text("root's")
    for _ in range(2):
        code, output = run(out)
        assert code == 0, output
    assert (out / "root-notes.txt").read_text() == "root's"
    assert (out / "config.json").read_text() == NEW["config.json"]
    assert ours_left(out) == []


def test_as_another_user_a_sticky_out_with_someone_elses_merge_is_refused(nobody):
    """In a sticky OUT the kernel lets nobody replace root's files: refused
    before anything moves, in one message."""
    root, _user, run = nobody
    out = root / "shared"
    out.mkdir()
    staged_merge(str(out), writer(OLD))  # as root
    out.chmod(0o1777)
    (out / STATE).chmod(0o777)
    before = tree(out)
    code, output = run(out)
    assert code == 1 and "belongs to another user" in output, output
    assert tree(out) == before


@pytest.mark.parametrize(
    "fails_at, message",
    [("model.safetensors", "is half-published"), (MANIFEST, "holds the new merge")],
)
def test_a_publish_the_os_stops_is_finished_by_the_next_run(
    previous, tmp_path, monkeypatch, fails_at, message
):
    """A step the OS refuses after the journal (EIO, a permission) is one
    message saying where OUT stands; the next run finishes that publish."""
    real = os.replace

    def refuse(source, destination, *args, **kwargs):
        if os.path.basename(destination) == fails_at:
            raise OSError(errno.EIO, os.strerror(errno.EIO), destination)
        return real(source, destination, *args, **kwargs)

    monkeypatch.setattr(output_folder.os, "replace", refuse)
    with pytest.raises(OutputError, match=message):
        staged_merge(str(previous), writer(NEW))
    monkeypatch.undo()
    assert (previous / "config.json").exists() == (fails_at == MANIFEST)
    assert (previous / STATE / JOURNAL).exists()
    with pytest.raises(RuntimeError):
        staged_merge(str(previous), failing)  # finishes the publish, then fails
    assert tree(previous) == expected(NEW, tmp_path / "want")
    assert ours_left(previous) == []
