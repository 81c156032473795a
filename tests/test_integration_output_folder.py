"""mergekit_ram.integration.output_folder: lock, staging, manifest, publish.

The protocol alone, with a stand-in for mergekit that writes a few files; the
whole merges that exercise it are in test_integration_publishing*.py. OUT is
always a user's folder here: notes, a `.git`, a symlink, a read-only file.
The every-step test interrupts a real child process at each file-system step
(SIGKILL, SIGTERM, SIGINT, SIGHUP), then runs a merge that fails and one that
succeeds. Mounts and other users are real where this machine allows them
(root), skipped with the reason elsewhere.
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
    long_path,
    ours_left,
    run_interrupted,
)

import mergekit_ram.integration.output_folder as output_folder
from mergekit_ram.integration.output_folder import (
    OutputError,
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
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model-1.safetensors")


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


def manifest(out: Path) -> list:
    return json.loads((out / STATE / MANIFEST).read_text())["files"]


# --- publishing -------------------------------------------------------------------


def test_publish_replaces_the_old_merge_and_keeps_user_files(previous, tmp_path):
    """The old merge's shards, index and tokenizer go; the user's files,
    `.git` included, stay byte for byte; only the manifest is left."""
    user = user_tree(previous)
    staged_merge(str(previous), writer(NEW))
    assert tree(previous) == expected(NEW, tmp_path / "want")
    assert user_tree(previous) == user
    assert sorted(name for name, *_ in manifest(previous)) == sorted(NEW)
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


STOCK = {  # what stock mergekit writes: no manifest, so nothing provably a merge's
    "config.json": "stock config",
    "mergekit_config.yml": "stock recipe",
    "model.safetensors": "stock weights",
    "README.md": "stock card",
}


def test_a_pytorch_model_bin_the_user_put_into_a_stock_merge_is_kept(tmp_path):
    """Problem 1: no file is guessed to be a merge's by its name. Same-named
    files are replaced (as stock mergekit replaces them); the user's .bin
    stays, and a loader still takes the new safetensors."""
    out = tmp_path / "out"
    out.mkdir()
    writer({**STOCK, "pytorch_model.bin": "the user's own model"})(str(out))
    staged_merge(str(out), writer(NEW))
    assert (out / "pytorch_model.bin").read_text() == "the user's own model"
    assert tree(out) == {**tree(writer_root(tmp_path, NEW)), **only(out, "pytorch")}


def writer_root(tmp_path: Path, files: dict[str, str]) -> Path:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    writer(files)(str(root))
    return root


def only(out: Path, prefix: str) -> dict[str, str]:
    return {k: v for k, v in tree(out).items() if k.startswith(prefix)}


def test_weights_the_user_replaced_are_kept_beside_no_merge(tmp_path):
    """Problem 2: the user replaced the merge's model.safetensors with their
    own (the manifest shows it changed): a sharded merge would leave it
    where a loader takes it first, so it is refused, naming the file, before
    anything is published; the file stays byte for byte."""
    out = tmp_path / "out"
    staged_merge(str(out), writer(NEW))
    (out / "model.safetensors").write_text("the user's fine-tune, longer")
    before = tree(out)
    with pytest.raises(OutputError, match="holds model.safetensors, which no merge"):
        staged_merge(str(out), writer(OLD))
    assert tree(out) == before and ours_left(out) == []
    staged_merge(str(out), writer(NEWER))  # a single-file merge replaces it, as stock
    assert (out / "model.safetensors").read_text() == "newer weights"


def test_an_index_no_merge_of_ours_wrote_beside_a_single_file_merge_is_refused(
    tmp_path,
):
    """A sharded folder stock mergekit wrote, then a single-file merge: its
    index would stay and mergekit would load the old shards."""
    out = tmp_path / "out"
    out.mkdir()
    writer(OLD)(str(out))
    before = tree(out)
    with pytest.raises(OutputError, match="holds model.safetensors.index.json"):
        staged_merge(str(out), writer(NEW))
    assert tree(out) == before and ours_left(out) == []
    staged_merge(str(out), writer(OLD))  # the same layout replaces each by name
    assert tree(out) == before


def test_weights_in_the_way_of_every_layout_are_refused_before_merging(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    writer({"model.safetensors": "a", "model.safetensors.index.json": "b"})(str(out))
    called = []
    with pytest.raises(OutputError, match="model.safetensors, model.safetensors.i"):
        staged_merge(str(out), called.append)
    assert not called and sorted(os.listdir(out)) == sorted(
        ["model.safetensors", "model.safetensors.index.json"]
    )


def test_a_new_folder_with_missing_parents(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    staged_merge(str(out), writer(NEW))
    assert tree(out) == {
        k: hashlib.sha256(v.encode()).hexdigest() for k, v in NEW.items()
    }
    assert ours_left(out) == []


@pytest.mark.parametrize("where", ["new", "empty", "parents"])
def test_a_failed_merge_leaves_no_folder_it_made(tmp_path, where):
    out = tmp_path / ("out" if where != "parents" else "a/b/out")
    if where == "empty":
        out.mkdir()
    with pytest.raises(OutputError, match="No space left on device.* is as it was"):
        staged_merge(str(out), failing)
    if where == "empty":  # the user's folder stays, empty as it was
        assert os.listdir(out) == []
    else:
        assert os.listdir(tmp_path) == []


def test_a_failed_merge_leaves_the_previous_one_and_the_manifest(previous):
    before, recorded = tree(previous), manifest(previous)
    with pytest.raises(OutputError, match="is as it was"):
        staged_merge(str(previous), failing)
    assert tree(previous) == before and manifest(previous) == recorded
    assert ours_left(previous) == []


def test_a_users_folder_survives_a_killed_merge_and_a_failing_one(tmp_path):
    """Problem 3: the user made OUT (empty, mode 2770); a merge is killed
    while writing into it, the next one fails: the folder stays, as it was."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o2770)
    code, output, _ = run_protocol(tmp_path, out, 4, "SIGKILL")  # staged, not published
    assert code == -signal.SIGKILL and (out / STATE / "staged").is_dir(), output
    with pytest.raises(OutputError):
        staged_merge(str(out), failing)
    assert os.listdir(out) == [] and stat.S_IMODE(out.stat().st_mode) == 0o2770


def test_long_and_odd_names(previous, tmp_path):
    out = tmp_path / ("m é$ 'x\"" + "m" * 230)
    previous.rename(out)
    user = user_tree(out)
    staged_merge(str(out), writer(NEW))
    assert user_tree(out) == user and (out / "config.json").read_text() == "new config"
    assert ours_left(out) == []


def test_an_out_path_of_3950_characters_merges(tmp_path):
    """Problem 4: stock mergekit writes there; our staging path never holds
    OUT's name, so its files' paths stay below the system's limit."""
    out = long_path(tmp_path, 3950)
    assert len(str(out)) == 3950
    staged_merge(str(out), writer(OLD))
    staged_merge(str(out), writer(NEW))
    assert sorted(os.listdir(out)) == sorted([STATE, *NEW])


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


def test_sigterm_and_sighup_handlers_are_restored(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    staged_merge(str(tmp_path / "out"), writer(NEW))
    assert {s: signal.getsignal(s) for s in before} == before


# --- the OS refusing a step: one error that says where OUT stands ------------------


def refuse(monkeypatch, name: str, code: int, when) -> None:
    """output_folder's os.<name> fails with `code` on the call when(path) holds."""
    real = getattr(os, name)

    def refused(*args, **kwargs):
        if when(str(args[-1] if name == "replace" else args[0])):
            raise OSError(code, os.strerror(code), args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(output_folder.os, name, refused)


def manifests(path: str) -> bool:
    return path.endswith(os.sep + MANIFEST)


@pytest.mark.parametrize(
    "name, code, when, state",
    [
        ("replace", errno.EPERM, manifests, "old"),
        ("replace", errno.ENOSPC, manifests, "old"),
        ("fsync", errno.EIO, lambda path: True, "old"),
        ("unlink", errno.EPERM, lambda p: p.endswith(f"out{os.sep}config.json"), "old"),
        (
            "replace",
            errno.EPERM,
            lambda path: path.endswith("model.safetensors"),
            "half",
        ),
    ],
    ids=["manifest EPERM", "manifest full", "fsync EIO", "immutable OUT", "a move"],
)
def test_a_step_the_os_refuses_says_where_out_stands(
    previous, tmp_path, monkeypatch, name, code, when, state
):
    """Problems 7-9: the OS refusing the manifest (EPERM for EROFS / EIO), a
    full disk there, OUT made immutable right after it: one OutputError
    that truly says OUT is the complete old merge (or half-published); the
    next run publishes exactly its merge."""
    refuse(monkeypatch, name, code, when)
    said = {"old": "is as it was", "half": "has no config.json"}[state]
    with pytest.raises(OutputError, match=f"{os.strerror(code)}.*{said}"):
        staged_merge(str(previous), writer(NEW))
    monkeypatch.undo()
    if state == "old":
        assert tree(previous) == expected(OLD, tmp_path / "old")
    else:
        assert "config.json" not in tree(previous)
    staged_merge(str(previous), writer(NEWER))
    assert tree(previous) == expected(NEWER, tmp_path / "newer")
    assert ours_left(previous) == []


def test_a_full_disk_when_the_manifest_is_rewritten_says_out_holds_the_new_merge(
    previous, tmp_path, monkeypatch
):
    seen = []  # the second manifest write: after the renames
    refuse(
        monkeypatch,
        "replace",
        errno.ENOSPC,
        lambda p: manifests(p) and seen.append(p) or len(seen) > 1,
    )
    with pytest.raises(OutputError, match="No space left.*holds the new merge"):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == expected(NEW, tmp_path / "new")


def test_our_folder_removed_during_the_merge_is_one_error(previous):
    """Problem 6 (the whole command: test_integration_publishing_swap.py)."""

    def removing(staged: str) -> None:
        shutil.rmtree(previous / STATE)
        Path(staged, "config.json").write_text("new")

    before = tree(previous)
    with pytest.raises(OutputError, match="No such file or directory.* is as it was"):
        staged_merge(str(previous), removing)
    assert tree(previous) == before and ours_left(previous) == []


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
    """An empty OUT (an unset "$OUTDIR") never means the current folder."""
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
        staged_merge(out, called.append)
    assert not called and tree(tmp_path) == before


# --- the lock --------------------------------------------------------------------


def test_one_lock_for_every_spelling(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    spellings = ["real", "./real", str(tmp_path / "real"), "link", "link/../real"]
    assert {resolve_output(s) for s in spellings} == {str(tmp_path / "real")}

    def second_merges(staged: str) -> None:
        for spelled in spellings:
            with pytest.raises(OutputError, match="Another merge is writing"):
                staged_merge(spelled, writer(NEWER))
        writer(NEW)(staged)

    staged_merge("link", second_merges)
    assert ours_left(tmp_path / "real") == []
    assert tree(tmp_path / "real") == tree(writer_root(tmp_path, NEW))


RACER = """
import sys, time
from pathlib import Path
from mergekit_ram.integration.output_folder import OutputError, staged_merge
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
try:
    staged_merge(sys.argv[1], lambda s: Path(s, "config.json").write_text("x"))
except OutputError as error:
    print(error)
"""


def test_merges_racing_into_a_new_folder_win_or_say_another_merge_is_writing(
    tmp_path,
):
    """Problem 5: whichever loses the race to make `.mergekit-ram` (or its
    lock) says another merge is writing; none fails otherwise."""
    for round_ in range(3):
        out, start = tmp_path / f"out{round_}", time.time() + 2
        racers = [
            subprocess.Popen(
                [sys.executable, "-c", RACER, str(out), str(start)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(6)
        ]
        for racer in racers:
            output = racer.communicate(timeout=60)[0]
            assert racer.returncode == 0, output
            assert output == "" or output.startswith("Another merge is writing"), output
        assert (out / "config.json").read_text() == "x" and ours_left(out) == []


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
    with pytest.raises(OutputError, match="which mergekit-ram did not make"):
        staged_merge(str(previous), writer(NEW))
    assert tree(previous) == before and tree(tmp_path / "elsewhere") == elsewhere


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_lock_file_replaced_by_a_link_or_a_pipe_is_refused(previous, tmp_path, kind):
    (tmp_path / "theirs").write_text("theirs")
    if kind == "symlink":
        os.symlink(tmp_path / "theirs", previous / STATE / "lock")
    else:
        os.mkfifo(previous / STATE / "lock")
    with pytest.raises(OutputError, match="which mergekit-ram did not make"):
        staged_merge(str(previous), writer(NEW))
    assert (tmp_path / "theirs").read_text() == "theirs"


# --- our state from a clone or a copy: untrusted -----------------------------------


def hostile_manifests(out: Path) -> dict[str, object]:
    notes = os.lstat(out / "notes.txt")
    wrong = [notes.st_size, notes.st_mtime_ns + 1]
    return {
        "names the user's files": [["notes.txt", *wrong], [".git", 4096, 0]],
        "leads elsewhere": [
            [name, *wrong]
            for name in ("../outside.txt", "/etc/hostname", "eval/scores.csv", "..")
        ],
        "a bad entry among good ones": [["notes.txt", *wrong], ["x", 1, True]],
        "not a list": {"notes.txt": wrong},
    }


@pytest.mark.parametrize(
    "hostile",
    [
        "names the user's files",
        "leads elsewhere",
        "a bad entry among good ones",
        "not a list",
        "garbage",
        "nested too deep",
        "a symlink",
        "a fifo",
        "huge",
    ],
)
def test_a_hostile_manifest_costs_no_user_file(previous, tmp_path, hostile):
    (tmp_path / "outside.txt").write_text("outside")
    path = previous / STATE / MANIFEST
    path.unlink()
    documents = hostile_manifests(previous)
    if hostile in documents:
        path.write_text(
            json.dumps({**output_folder.FORMAT, "files": documents[hostile]})
        )
    elif hostile == "garbage":
        path.write_bytes(b"\x00{not json")
    elif hostile == "nested too deep":  # json's parser recurses
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif hostile == "a symlink":
        (tmp_path / "theirs.json").write_text(json.dumps({"files": []}))
        os.symlink(tmp_path / "theirs.json", path)
    elif hostile == "a fifo":  # opening it to read would block
        os.mkfifo(path)
    else:
        with open(path, "wb") as handle:
            handle.truncate(output_folder.LIMIT + 1)
    user = user_tree(previous)
    # Nothing is provably the old merge's now: the same layout replaces it.
    staged_merge(str(previous), writer({**OLD, "config.json": "new config"}))
    assert user_tree(previous) == user
    assert (tmp_path / "outside.txt").read_text() == "outside"
    assert (previous / "config.json").read_text() == "new config"
    assert ours_left(previous) == []


@pytest.mark.parametrize("inside", [False, True, "a file"])
def test_leftover_staging_with_links_is_removed_not_followed(
    previous, tmp_path, inside
):
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "precious.txt").write_text("precious")
    staging = previous / STATE / "staged"
    if inside == "a file":
        staging.write_text("a killed run's, or a clone's")
    elif inside:
        (staging / "merge").mkdir(parents=True)
        os.symlink(tmp_path / "theirs", staging / "merge" / "tokenizer")
    else:
        os.symlink(tmp_path / "theirs", staging)
    staged_merge(str(previous), writer(NEW))
    assert (tmp_path / "theirs" / "precious.txt").read_text() == "precious"
    assert ours_left(previous) == []


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
    """Which state OUT is in: old, new, or a folder without config.json
    holding only files of the two merges (and every user file)."""
    name = next((k for k, v in states.items() if v == state), None)
    if name is not None:
        return name
    assert state is not None and "config.json" not in state, state
    old, new = states["old"] or {}, states["new"]
    for name, value in state.items():
        if name.split(os.sep)[0] not in USER:
            assert value in (old.get(name), new.get(name)), name
    assert {k: v for k, v in state.items() if k.split(os.sep)[0] in USER} == {
        k: v for k, v in new.items() if k.split(os.sep)[0] in USER
    }
    return "half"


def sweep(folder: Path, scenario: str, every_signal: bool) -> set[str]:
    """Interrupt a run at every step (with each signal, or with one taking
    turns), then a failing run and a succeeding one; the states seen."""
    code, output, steps = run_protocol(
        folder, make_out(folder / "count", scenario), 0, "SIGKILL"
    )
    assert code == 0 and steps >= 10, output
    states: dict = {"old": None}
    for label, files in (("old", OLD), ("new", NEW), ("newer", NEWER)):
        if scenario == "previous merge":
            states[label] = expected(files, folder / label)
        elif label != "old":
            states[label] = tree(writer_root(folder, files))
    seen = set()
    for step in range(1, steps + 1):
        for how in SIGNALS if every_signal else [SIGNALS[step % len(SIGNALS)]]:
            out = make_out(folder / f"{step}-{how}", scenario)
            code, output, _ = run_protocol(folder, out, step, how)
            assert code in EXITS[how], (step, how, output)
            found = tree(out) if out.exists() else None
            if found == {} and states["old"] is None:
                found = None  # a new folder made, nothing of a merge in it
            state = settled(found, states)
            seen.add(state)
            if how != "SIGKILL":
                check_exit(how, code, state, output)
            with pytest.raises(OutputError):
                staged_merge(str(out), failing)
            found = tree(out) if out.exists() else None
            after = settled(None if found == {} else found, states)
            assert after == state, (step, how)
            assert ours_left(out) == [], (step, how)
            staged_merge(str(out), writer(NEWER))
            assert tree(out) == states["newer"] and ours_left(out) == [], (step, how)
    return seen


def test_interrupted_at_every_step_then_next_runs(memory_tmp):
    """Rule 6, one signal per step, taking turns: after a kill OUT is the
    old merge, the new one, or a folder without config.json holding only
    files of the two; a signal but SIGKILL says which in one line; so is it
    after a failing run; a succeeding run leaves exactly its merge; user
    files byte for byte throughout; nothing of ours left but the manifest."""
    assert sweep(memory_tmp, "previous merge", every_signal=False) == {
        "old",
        "new",
        "half",
    }


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["previous merge", "new folder"])
def test_every_signal_at_every_step_then_next_runs(memory_tmp, scenario):
    assert {"new", "half"} <= sweep(memory_tmp, scenario, every_signal=True)


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


def test_one_folder_under_two_paths_has_one_lock(tmpfs, previous, tmp_path):
    """Item 5: a bind mount shows OUT under a second path."""
    tmpfs(tmp_path / "probe")  # skips where mounting is not permitted
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["mount", "--bind", str(previous), str(other)], check=True)
    try:

        def second(staged: str) -> None:
            with pytest.raises(OutputError, match="Another merge"):
                staged_merge(str(other), writer(NEWER))

        staged_merge(str(previous), second)
        staged_merge(str(other), writer(NEW))
        assert (previous / "config.json").read_text() == "new config"
    finally:
        subprocess.run(["umount", str(other)], check=True)


def test_tmpfs_read_only_and_full(tmpfs, tmp_path):
    read_only = tmpfs(tmp_path / "ro", read_only=True)
    with pytest.raises(OutputError, match="Read-only file system"):
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
        with pytest.raises(OutputError, match="No space left on device.*is as it was"):
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


def test_as_another_user_a_sticky_out_with_someone_elses_merge(nobody):
    """In a sticky OUT the kernel lets nobody remove root's files: one
    error, after the manifest, that truly says OUT is the old merge."""
    root, _user, run = nobody
    out = root / "shared"
    out.mkdir()
    staged_merge(str(out), writer(OLD))  # as root
    out.chmod(0o1777)
    (out / STATE).chmod(0o777)
    before = tree(out)
    code, output = run(out)
    assert code == 1 and "Operation not permitted" in output, output
    assert f"{out} is as it was" in output and tree(out) == before
