"""One merge writes into OUT at a time, however OUT is spelled or mounted:
another one says "Another merge is writing" at once, and nothing of either
is lost. Also OUT on a mount, and as another user, where this machine
allows (root), skipped with the reason elsewhere."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from faults import NEW, NEWER, OLD, Driver, ours_left, tmpfs, tree, writer

import mergekit_ram.integration.output_folder as output_folder
from mergekit_ram.integration.output_folder import OutputError, staged_merge


def test_one_lock_for_every_spelling(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    spellings = ["real", "./real", str(tmp_path / "real"), "link", "link/../real"]

    def second_merges(staged: str) -> None:
        for spelled in spellings:
            with pytest.raises(OutputError, match="Another merge is writing"):
                staged_merge(spelled, writer(NEWER))
        writer(NEW)(staged)

    staged_merge("link", second_merges)
    assert ours_left(tmp_path / "real") == []
    assert (tmp_path / "real" / "config.json").read_text() == NEW["config.json"]


# Forks a racer per folder in argv; all wait on one pipe, go when it closes.
RACER = """
import os, sys
from pathlib import Path
from mergekit_ram.integration.output_folder import OutputError, staged_merge
go, start = os.pipe()
for where in sys.argv[1:]:
    if os.fork() == 0:
        os.close(start)
        os.read(go, 1)
        try:
            staged_merge(where, lambda s: Path(s, "config.json").write_text("x"))
        except OutputError as error:
            os.write(1, f"{str(error)!a}\\n".encode())  # one write: lines stay whole
        os._exit(0)
os.close(start)
print(sorted(os.wait()[1] for _ in sys.argv[1:]), flush=True)
"""


def test_racing_merges_win_or_say_another_merge_is_writing(tmp_path):
    """Six merges into one new folder at once, and six each into a folder
    inside the previous one's: each publishes or says another merge is writing."""
    outs = [tmp_path / "one" for _ in range(6)]
    outs += [Path(tmp_path / "nested", *["sub"] * i) for i in range(6)]
    racing = [sys.executable, "-c", RACER, *map(str, outs)]
    said = subprocess.run(racing, capture_output=True, text=True, timeout=60)
    *lines, statuses = said.stdout.splitlines()
    assert statuses == str([0] * len(outs)), said.stdout + said.stderr
    assert all(line.startswith("'Another merge is writing") for line in lines), lines
    for where in outs:
        assert (where / "config.json").read_text() == "x" and ours_left(where) == []


@pytest.fixture
def mount():
    """mount(point, size, read_only) -> a fresh tmpfs at point; all unmounted after."""
    with contextlib.ExitStack() as mounted:
        yield lambda *args, **kwargs: mounted.enter_context(tmpfs(*args, **kwargs))


def test_mounts_as_out_below_out_and_a_second_path_to_out(mount, tmp_path):
    """A Docker volume is a mount point; a mount below OUT keeps its files; a
    bind mount shows OUT under a second path, with one lock."""
    out = mount(tmp_path / "volume")
    disk = mount(out / "data" / "disk")
    (disk / "dataset.jsonl").write_text("rows")
    staged_merge(str(out), writer(OLD))
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["mount", "--bind", str(out), str(other)], check=True)
    try:

        def second(staged: str) -> None:
            with pytest.raises(OutputError, match="Another merge"):
                staged_merge(str(other), writer(NEWER))
            writer(NEW)(staged)

        staged_merge(str(out), second)
    finally:
        subprocess.run(["umount", str(other)], check=True)
    assert (disk / "dataset.jsonl").read_text() == "rows"
    assert sorted(os.listdir(out)) == sorted([*NEW, "data", ".mergekit-ram"])


def test_a_read_only_or_full_mount_is_one_error_out_as_it_was(mount, tmp_path):
    read_only = mount(tmp_path / "ro", read_only=True)
    with pytest.raises(OutputError, match="Read-only file system"):
        staged_merge(str(read_only / "out"), writer(NEW))
    out = mount(tmp_path / "small", size="64k")
    staged_merge(str(out), writer(OLD))
    before = tree(out)

    def huge_tensors(staged: str) -> None:
        """mergekit's writer: safetensors says a full disk in words only."""
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(250_000)}, str(Path(staged, "model.safetensors")))

    with pytest.raises(OutputError, match="No space left on device.*is as it was"):
        staged_merge(str(out), huge_tensors)
    assert tree(out) == before and ours_left(out) == []


@pytest.fixture
def nobody(tmp_path):
    """run(out) -> a protocol run as the user `nobody`, in a folder it can reach."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run as another user")
    import filelock

    user = pwd.getpwnam("nobody")
    ids = (f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups")
    reach = [
        Path(output_folder.__file__).parents[2],
        Path(filelock.__file__).parents[1],
    ]
    env = {"PYTHONPATH": os.pathsep.join(str(p) for p in reach)}
    # What the driver imports (the package, filelock, safetensors), not less.
    probe = [sys.executable, "-c", "import mergekit_ram.integration.output_folder"]
    if subprocess.run(["setpriv", *ids, *probe], env={**os.environ, **env}).returncode:
        pytest.skip("no Python and package here that `nobody` may run")
    root = Path(tempfile.mkdtemp(prefix="mergekit-ram-nobody-"))
    root.chmod(0o755)
    driver = Driver(prefix=("setpriv", *ids), env=env)
    yield root, user, lambda out: driver.publish(out, 0, "SIGKILL")
    driver.close()
    shutil.rmtree(root)


def test_as_another_user_in_shared_and_sticky_folders(nobody):
    """A read-only subfolder in nobody's OUT inside a folder nobody may not
    write; a root-owned OUT in a sticky folder, holding root's merge, which
    the kernel lets nobody not remove: one error saying OUT is as it was."""
    root, user, run = nobody
    out = root / "readonly-parent" / "out"
    (out / "results").mkdir(parents=True)
    (out / "results" / "run1.txt").write_text("kept")
    for path in (out, out / "results", out / "results" / "run1.txt"):
        os.chown(path, user.pw_uid, user.pw_gid)
    (out / "results").chmod(0o555)
    out.parent.chmod(0o555)
    for _ in range(2):
        code, output, _ = run(out)
        assert code == 0, output
    assert (out / "results" / "run1.txt").read_text() == "kept" and not ours_left(out)
    out.parent.chmod(0o755)
    (out / "results").chmod(0o755)
    shared = root / "shared"
    shared.mkdir()
    staged_merge(str(shared), writer(OLD))  # as root
    shared.chmod(0o1777)
    (shared / ".mergekit-ram").chmod(0o777)
    before = tree(shared)
    code, output, _ = run(shared)
    assert code == 1 and "Operation not permitted" in output, output
    assert f"{shared} is as it was" in output and tree(shared) == before
