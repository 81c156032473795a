"""mergekit_ram.integration.output_folder: identity, lock, staging, publish, recovery.

The protocol alone, with a stand-in for mergekit that writes a few files; the
whole merges that exercise it are in test_integration_publishing*.py. The
fault-injection test interrupts a real child process at every file-system
step of a publish (SIGKILL, SIGTERM, SIGINT) and then runs a next merge that
fails and one that succeeds.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faults import EXITS, SIGNALS, run_interrupted

import mergekit_ram.integration.output_folder as output_folder
from mergekit_ram.integration.output_folder import (
    OutputError,
    Staging,
    carried_names,
    check_output,
    lock_path,
    locked,
    recover_stale,
    resolve_output,
    staged_merge,
)


def tree(folder: Path) -> dict[str, str]:
    """Every entry under folder: sha256 of files, link targets, 'dir'."""
    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        elif path.is_dir():
            found[name] = "dir"
        else:
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def ours_left(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(output_folder.TAG))


def writer(files: dict[str, str]):
    def write(staged: str) -> None:
        for name, text in files.items():
            Path(staged, name).parent.mkdir(parents=True, exist_ok=True)
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
}
NEW = {
    "config.json": "new config",
    "mergekit_config.yml": "new recipe",
    "model.safetensors": "new weights",
    "README.md": "new card",
}
NEWER = {**NEW, "model.safetensors": "newer weights"}


def with_user_files(out: Path) -> None:
    (out / "notes.txt").write_text("mine")
    (out / "eval").mkdir()
    (out / "eval" / "scores.csv").write_text("1,2")
    os.symlink("notes.txt", out / "latest")


def user_tree(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree(out).items() if k.split("/")[0] in USER}


USER = ("notes.txt", "eval", "latest")


@pytest.fixture
def previous(tmp_path) -> Path:
    """OUT holding a previous (sharded) merge and the user's own files."""
    out = tmp_path / "out"
    out.mkdir()
    writer(OLD)(str(out))
    with_user_files(out)
    return out


# --- carrying, identity, lock ------------------------------------------------


def test_carried_names_keep_only_the_users_files():
    existing = {*OLD, "notes.txt", "eval"}
    assert carried_names(existing, set(NEW)) == ["eval", "notes.txt"]
    # No previous merge: nothing of OUT is a merge's, so all but what is rewritten.
    user = {"README.md", "notes.txt", "config.json"}
    assert carried_names(user, {"config.json"}) == ["README.md", "notes.txt"]
    # --no-write-model-card: a previous card (or the user's README) stays.
    assert "README.md" in carried_names(existing, {"config.json"})


def test_one_identity_for_every_spelling(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    spellings = ["real", "./real", str(tmp_path / "real"), "link", "link/../real"]
    assert {resolve_output(s) for s in spellings} == {str(tmp_path / "real")}
    assert {lock_path(resolve_output(s)) for s in spellings} == {
        lock_path(str(tmp_path / "real"))
    }
    with locked(resolve_output("link")):
        with pytest.raises(OutputError, match="Another merge"):
            staged_merge("./real", writer(NEW))
    assert not (tmp_path / "real" / "config.json").exists()


def test_lock_is_exclusive_and_removed(tmp_path):
    out = str(tmp_path / "out")
    with locked(out):
        with pytest.raises(OutputError, match="Another merge"):
            with locked(out):
                pass
    assert os.listdir(tmp_path) == []
    with locked(out):  # free again
        pass


NO_FCNTL = """
import sys
from pathlib import Path

sys.modules["fcntl"] = None  # as on Windows: `import fcntl` fails
import mergekit_ram
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from mergekit_ram.integration.output_folder import OutputError, locked

document = yaml.safe_load(Path(sys.argv[1]).read_text())
config = MergeConfiguration.model_validate(document)
mergekit_ram.run_merge(config, sys.argv[2], MergeOptions(quiet=True))
with locked(sys.argv[2]):
    try:
        with locked(sys.argv[2]):
            sys.exit("a second writer took the lock")
    except OutputError:
        print("REFUSED")
"""


def test_imports_locks_and_merges_without_fcntl(family_f32, tmp_path):
    """Where fcntl does not exist (Windows) the package imports, a second
    writer is still refused and a real merge is published."""
    config = tmp_path / "ram.yml"
    config.write_text(family_f32.yaml("ramplus"), encoding="utf-8")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", NO_FCNTL, str(config), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["REFUSED"]
    assert (out / "model.safetensors").is_file()
    assert (out / "ram_statistics.json").is_file()
    assert ours_left(tmp_path) == []


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: os.symlink(t / "nowhere", t / "out"), "symlink to nothing"),
        (lambda t: (t / "file").write_text("x"), "which is a file"),
        (lambda t: os.symlink(t / "loop", t / "loop"), "symlink loop"),
    ],
    ids=["dangling symlink", "parent is a file", "symlink loop"],
)
def test_unpublishable_paths_are_refused_before_anything(tmp_path, make, message):
    make(tmp_path)
    out = {
        "symlink to nothing": tmp_path / "out",
        "which is a file": tmp_path / "file" / "out",
        "symlink loop": tmp_path / "loop" / "x" / "out",
    }[message]
    before = sorted(os.listdir(tmp_path))
    called = []
    with pytest.raises(OutputError, match=message):
        staged_merge(str(out), lambda staged: called.append(staged))
    assert not called and sorted(os.listdir(tmp_path)) == before


def test_mount_point_is_refused(monkeypatch, tmp_path):
    out = tmp_path / "mnt"
    out.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: p == str(out))
    with pytest.raises(OutputError, match="is a mount point"):
        staged_merge(str(out), writer(NEW))


def test_read_only_parent_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(output_folder.os, "open", read_only)
    with pytest.raises(OutputError, match="does not accept new files"):
        staged_merge(str(tmp_path / "out"), writer(NEW))


def test_long_output_name_publishes(previous, tmp_path):
    out = tmp_path / ("m" * 250)
    previous.rename(out)
    user = user_tree(out)
    staged_merge(str(out), writer(NEW))
    assert user_tree(out) == user and (out / "config.json").read_text() == "new config"
    assert not ours_left(tmp_path)


def test_symlinked_out_publishes_into_its_target(previous, tmp_path):
    os.symlink(previous, tmp_path / "link")
    staged_merge(str(tmp_path / "link"), writer(NEW))
    assert (tmp_path / "link").is_symlink()
    assert (previous / "model.safetensors").read_text() == "new weights"
    assert not (previous / "model-00001-of-00002.safetensors").exists()


def test_full_disk_is_one_message_and_out_intact(previous, tmp_path):
    before = tree(previous)

    def full(staged: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), staged + "/x")

    with pytest.raises(OutputError, match="The disk is full"):
        staged_merge(str(previous), full)
    assert tree(previous) == before and not ours_left(tmp_path)


def test_foreign_weights_in_out_are_refused(tmp_path):
    (tmp_path / "model.safetensors").write_text("someone's model")
    with pytest.raises(OutputError, match="no mergekit_config.yml"):
        check_output(str(tmp_path))


def test_sigterm_handler_is_restored(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    staged_merge(str(tmp_path / "out"), lambda staged: None)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_failed_merge_into_a_new_folder_leaves_no_folder(tmp_path):
    with pytest.raises(RuntimeError):
        staged_merge(str(tmp_path / "new" / "deeper" / "out"), failing)
    assert os.listdir(tmp_path) == []


def test_publish_replaces_the_old_merge_and_keeps_user_files(previous, tmp_path):
    user = user_tree(previous)
    staged_merge(str(previous), writer(NEW))
    assert user_tree(previous) == user
    assert {k for k in tree(previous) if k.split("/")[0] not in USER} == set(NEW)
    assert not ours_left(tmp_path)


# --- what may be removed -----------------------------------------------------


def test_folders_not_provably_ours_are_never_removed(previous, tmp_path):
    """Item 2: siblings that look like staging folders but are not ours."""
    key = output_folder._key(str(previous))
    lookalikes = {
        ".out.mergekit-ram-backup": {"x.txt": "user"},
        ".out.mergekit-ram-1-x": {"config.json": "another merge's OUT"},
        f".mergekit-ram-{key}-{'0' * 16}": {"owner.json": "{not json"},
        f".mergekit-ram-{key}-{'1' * 16}": {
            "owner.json": json.dumps({"token": "2" * 16, "out": str(previous)}),
            "data.bin": "someone's",
        },
        f".mergekit-ram-{'f' * 12}-{'3' * 16}": {"data.bin": "another OUT's"},
    }
    for name, files in lookalikes.items():
        (tmp_path / name).mkdir()
        writer(files)(str(tmp_path / name))
    before = {name: tree(tmp_path / name) for name in lookalikes}
    staged_merge(str(previous), writer(NEW))
    assert {name: tree(tmp_path / name) for name in lookalikes} == before


def test_a_live_owners_staging_is_left_alone(previous, tmp_path):
    staging = Staging.create(str(previous))  # owner: this (live) process
    recover_stale(str(previous))
    assert os.path.isdir(staging.root)
    staging.recover()
    assert not ours_left(tmp_path)


def test_windows_never_probes_an_owner_with_a_signal(previous, tmp_path, monkeypatch):
    """os.kill(pid, 0) sends Ctrl-C on Windows: there R's lock alone decides."""

    class Windows:
        name = "nt"

        def __getattr__(self, name: str):
            return getattr(os, name)

        @staticmethod
        def kill(pid: int, signum: int) -> None:
            raise AssertionError(f"os.kill({pid}, {signum})")

    Staging.create(str(previous))  # owner: this (live) process
    monkeypatch.setattr(output_folder, "os", Windows())
    recover_stale(str(previous))
    assert not ours_left(tmp_path)


# --- interrupting a real process at every file-system step --------------------


def run_protocol(folder: Path, out: Path, step: int, how: str):
    files = ";".join(f"{k}={v}" for k, v in NEW.items())
    args = [output_folder.__file__, str(out), files]
    return run_interrupted(folder, step, how, "protocol", args)


def make_out(root: Path, scenario: str) -> Path:
    root.mkdir(parents=True)
    out = root / "out"
    if scenario == "previous merge":
        out.mkdir()
        writer(OLD)(str(out))
        with_user_files(out)
    return out


@pytest.fixture
def memory_tmp(tmp_path):
    """A folder on tmpfs where there is one (fsync is free there, the protocol
    the same), else tmp_path: hundreds of publishes stay fast."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="mergekit-ram-test-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder)


@pytest.mark.parametrize(
    "scenario",
    ["previous merge", pytest.param("new folder", marks=pytest.mark.slow)],
)
def test_interrupted_at_every_step_then_next_runs(memory_tmp, scenario, capsys):
    """Item 0/1/8: after a kill at any step, and a next run that fails, OUT
    is exactly old or exactly new; a next run that succeeds publishes; no
    staging folder or lock is left; the user's files are intact throughout."""
    tmp_path = memory_tmp
    code, output, steps = run_protocol(
        tmp_path, make_out(tmp_path / "count", scenario), 0, "SIGKILL"
    )
    assert code == 0, output
    assert steps >= (25 if scenario == "previous merge" else 12)
    old = make_out(tmp_path / "old", scenario)
    old_new = {"old": tree(old) if old.exists() else None}
    for label, files in (("new", NEW), ("newer", NEWER)):
        shown = tmp_path / label
        shown.mkdir()
        writer(files)(str(shown))
        if scenario == "previous merge":
            with_user_files(shown)
        old_new[label] = tree(shown)
    cases = 0
    for step in range(1, steps + 1):
        for how in SIGNALS:
            root = tmp_path / f"{step}-{how}"
            out = make_out(root, scenario)
            code, output, _ = run_protocol(tmp_path, out, step, how)
            assert code in EXITS[how], (step, how, output)
            state = tree(out) if out.exists() else None
            if how != "SIGKILL":  # the child cleaned up after itself
                assert state in (old_new["old"], old_new["new"]), (step, how)
                assert not ours_left(root), (step, how, output)
            with pytest.raises(RuntimeError):
                staged_merge(str(out), failing)
            state = tree(out) if out.exists() else None
            assert state in (old_new["old"], old_new["new"]), (step, how, output)
            assert not ours_left(root), (step, how)
            staged_merge(str(out), writer(NEWER))
            assert tree(out) == old_new["newer"], (step, how)
            assert not ours_left(root), (step, how)
            cases += 1
    with capsys.disabled():
        print(f"\n{scenario}: interrupted at {steps} file-system steps x 3 signals")
    assert cases == 3 * steps


# --- real mounts (tmpfs), where this machine lets the tests mount -------------


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size, read_only) -> a fresh tmpfs mount point; all unmounted after."""
    mounted: list[Path] = []

    def mount(size: str = "4m", read_only: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
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


def test_tmpfs_mount_point_refused_inside_it_and_through_a_link_published(
    tmpfs, tmp_path
):
    point = tmpfs()
    with pytest.raises(OutputError, match="is a mount point"):
        staged_merge(str(point), writer(NEW))
    assert os.listdir(point) == []
    out = point / "out"
    out.mkdir()
    writer(OLD)(str(out))
    with_user_files(out)
    user = user_tree(out)
    os.symlink(out, tmp_path / "link")  # on another file system than its target
    staged_merge(str(tmp_path / "link"), writer(NEW))
    assert user_tree(out) == user and (out / "config.json").read_text() == "new config"
    assert os.listdir(point) == ["out"]


def test_tmpfs_read_only_and_full(tmpfs):
    read_only = tmpfs(read_only=True)
    with pytest.raises(OutputError, match="does not accept new files"):
        staged_merge(str(read_only / "out"), writer(NEW))
    small = tmpfs(size="64k")
    out = small / "out"
    out.mkdir()
    writer(OLD)(str(out))
    before = tree(out)

    def huge(staged: str) -> None:
        Path(staged, "model.safetensors").write_bytes(b"\0" * 1_000_000)

    with pytest.raises(OutputError, match="The disk is full"):
        staged_merge(str(out), huge)
    assert tree(out) == before and os.listdir(small) == ["out"]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def killed_between_the_renames(spelled: str) -> Staging:
    """What SIGKILL between the two renames leaves: OUT moved aside, the new
    merge staged, the owner gone."""
    target = resolve_output(spelled)
    staging = Staging.create(target)
    writer(NEW)(staging.model)
    os.rename(target, staging.previous)
    marker = Path(staging.root, output_folder.OWNER)
    owner = json.loads(marker.read_text())
    marker.write_text(json.dumps({**owner, "pid": dead_pid(), "started": None}))
    return staging


def test_a_killed_run_is_repaired_whatever_the_spelling(previous, tmp_path):
    """Item 8: killed through a symlink, repaired by a run spelled otherwise
    (that then fails): OUT is the old merge again, nothing of ours is left."""
    before = tree(previous)
    os.symlink(previous, tmp_path / "link")
    killed_between_the_renames(str(tmp_path / "link"))
    assert not previous.exists()
    with pytest.raises(RuntimeError):
        staged_merge(os.path.relpath(previous), failing)
    assert tree(previous) == before
    assert ours_left(tmp_path) == []


def test_a_mount_inside_out_is_refused(tmpfs, previous):
    point = tmpfs()
    target = previous / "scratch"
    target.mkdir()
    subprocess.run(["mount", "--bind", str(point), str(target)], check=True)
    try:
        before = tree(previous)
        with pytest.raises(OutputError, match="holds scratch, a mount point"):
            staged_merge(str(previous), writer(NEW))
        assert tree(previous) == before
    finally:
        subprocess.run(["umount", str(target)], check=True)
