"""Interrupting a real process at its Nth file-system step while it publishes.

`run_interrupted` starts a child that replaces the `os` module seen by
mergekit_ram.integration.output_folder with a proxy counting every mkdir,
makedirs, rename, replace, link, symlink, unlink, rmdir, fsync and write.
At step N the child sends itself SIGKILL, or SIGTERM / SIGINT / SIGHUP to
its main thread (odd N: to an idle thread, since a signal may land on any
thread of a merge and Python then handles it in the main thread), waits
until it is delivered (the wakeup fd), so that the step itself never runs.
Step 0 never interrupts: the child prints how many steps its run took.

Also what every publishing test shares: a stand-in merge that writes a few
files, OUT holding a user's files (notes, a `.git`, a link, a read-only
file), what of ours is left in OUT.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import mergekit_ram.integration.output_folder as output_folder
from mergekit_ram.integration.output_folder import staged_merge

TIMEOUT = 300
SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP")
# Nothing is held: SIGTERM and SIGHUP end the run with 128 + their number,
# Ctrl-C with Python's KeyboardInterrupt (the driver exits 130 on it, click
# says "Aborted!", exit 1). Never exit 0: that would mean a signal was dropped.
EXITS = {name: {128 + getattr(signal, name)} for name in SIGNALS}
EXITS["SIGKILL"] = {-signal.SIGKILL}
EXITS["SIGINT"] |= {1}
STATE = ".mergekit-ram"  # our folder inside OUT
MANIFEST = "manifest.json"  # what a finished run leaves there: the manifest,
GITIGNORE = ".gitignore"  # and a .gitignore that keeps our folder out of git
# What the line a signal ends the run with says, for each state OUT is in.
SAID = {"old": "is as it was", "new": "holds the new merge", "half": "has no config"}


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
    """A stand-in for mergekit: writes `files` into the staged folder."""

    def write(staged: str) -> None:
        for name, text in files.items():
            Path(staged, name).write_text(text)

    return write


def failing(staged: str) -> None:
    """A stand-in merge that fails: a full disk while it writes a shard."""
    Path(staged, "model-1.safetensors").write_text("partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "model-1.safetensors")


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


def expected(files: dict[str, str], root: Path, user: bool = True) -> dict[str, str]:
    """tree() of a folder holding exactly `files` (and the user's files)."""
    root.mkdir()
    writer(files)(str(root))
    if user:
        with_user_files(root)
    return tree(root)


def make_previous(tmp_path: Path) -> Path:
    """OUT holding the user's files and a previous (sharded) merge we published."""
    out = tmp_path / "out"
    out.mkdir()
    with_user_files(out)
    staged_merge(str(out), writer(OLD))
    return out


@pytest.fixture
def previous(tmp_path: Path) -> Path:
    """make_previous's OUT (a fixture: conftest loads this module as a plugin)."""
    return make_previous(tmp_path)


def ours_left(out: Path) -> list[str]:
    """What of ours is in or next to OUT beyond a finished merge's manifest
    and .gitignore: staging, a lock (none after a run ends)."""
    inside = out / STATE
    left = sorted(os.listdir(inside)) if inside.is_dir() else []
    left = [f"{STATE}/{n}" for n in left if n not in (MANIFEST, GITIGNORE)]
    if inside.is_symlink() or (inside.exists() and not inside.is_dir()):
        left.append(STATE)
    beside = out.parent if out.parent.exists() else None
    if beside is not None:
        left += sorted(n for n in os.listdir(beside) if n.startswith(".mergekit-ram-"))
    return left


def long_path(root: Path, length: int) -> Path:
    """A path of `length` characters below root, in names of up to 200."""
    path = str(root)
    while len(path) < length:
        path += "/" + "d" * min(200, length - len(path) - 1)
    return Path(path)


def default_signals() -> None:
    """A signalled child's SIGINT, SIGTERM and SIGHUP as a terminal starts it
    (Python then raises KeyboardInterrupt on Ctrl-C), whatever this process
    ignores (`nohup bash scripts/test.sh &` ignores SIGINT and SIGHUP): else
    the child ignores the signal and the test waits for its timeout."""
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


@contextlib.contextmanager
def tmpfs(point: Path, size: str = "4m", read_only: bool = False):
    """A fresh tmpfs at point (skips the test where none can be mounted)."""
    point.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def raise_on(monkeypatch, owner, name: str, error: BaseException, when) -> None:
    """owner.name raises `error` on its `when`th call (an int), or on each
    call where when(*args) holds."""
    real, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == when if isinstance(when, int) else when(*args):
            raise error
        return real(*args, **kwargs)

    failing.__mergekit_ram__ = real  # our card patch is in place: kept, not redone
    monkeypatch.setattr(owner, name, failing)


WRITING = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("output_folder", sys.argv[1])
folder = sys.modules["output_folder"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(folder)
def write(staged):
    print("WRITING", flush=True)
    time.sleep(600)
folder.staged_merge(sys.argv[2], write)
"""


def writing(out: Path, started=default_signals) -> subprocess.Popen:
    """A child process holding OUT as a merge in progress does (the protocol
    alone, loaded by path: it starts in a blink)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITING, output_folder.__file__, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=started,
    )
    assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()
    return proc


def check_exit(how: str, code: int, state: str, output: str) -> None:
    """A signal other than SIGKILL: one line that says truly where OUT stands."""
    assert code in EXITS[how], (how, code, output)
    assert SAID[state] in output and "Traceback" not in output, (how, state, output)


DRIVER = """
import importlib.util, os, signal, sys, threading
from pathlib import Path

step, how, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
args = sys.argv[4:]
if mode == "protocol":  # output_folder alone, loaded by path: starts in a blink
    spec = importlib.util.spec_from_file_location("output_folder", args[0])
    folder = importlib.util.module_from_spec(spec)
    sys.modules["output_folder"] = folder
    spec.loader.exec_module(folder)
else:
    import mergekit_ram.integration.output_folder as folder

STEPS = (
    "mkdir", "makedirs", "rename", "replace", "link", "symlink", "unlink", "rmdir",
    "fsync", "write",
)
idle = threading.Thread(target=threading.Event().wait, daemon=True)
idle.start()
# A Python-level handler's C half writes each signal here: reading it tells
# that the signal was delivered, so Python handles it at its next step in
# the main thread, whichever thread received it.
delivered, wakeup = os.pipe()
os.set_blocking(wakeup, False)
signal.set_wakeup_fd(wakeup)


class Faulty:
    count = 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in STEPS:
            return real

        def step_then(*a, **k):
            Faulty.count += 1
            if Faulty.count == step:
                if how == "SIGKILL":
                    os.kill(os.getpid(), signal.SIGKILL)
                # To the main thread, or to another one (odd steps).
                thread = idle if step % 2 else threading.main_thread()
                signal.pthread_kill(thread.ident, getattr(signal, how))
                os.read(delivered, 1)
            return real(*a, **k)

        return step_then


folder.os = Faulty()
try:
    if mode == "protocol":
        out, files = args[1], args[2]

        def write(staged):
            for line in files.split(";"):
                name, text = line.split("=")
                Path(staged, name).write_text(text)

        try:
            folder.staged_merge(out, write)
        except KeyboardInterrupt:  # the run printed its line: exit as a shell would
            sys.exit(130)
    else:
        from mergekit.scripts.run_yaml import main

        main(args)
finally:
    print("STEPS", Faulty.count, flush=True)
"""


def run_protocol(folder: Path, out: Path, step: int, how: str, **options):
    """run_interrupted of the protocol alone, publishing NEW into out."""
    files = ";".join(f"{k}={v}" for k, v in NEW.items())
    args = [output_folder.__file__, str(out), files]
    return run_interrupted(folder, step, how, "protocol", args, **options)


def run_interrupted(
    folder: Path,
    step: int,
    how: str,
    mode: str,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
    python: str = sys.executable,
) -> tuple[int, str, int | None]:
    """(exit code, output, steps counted) of one child run (`prefix`: e.g.
    setpriv, to run it as another user, with a `python` that user can run)."""
    driver = folder / "fault_driver.py"
    if not driver.exists():
        driver.write_text(DRIVER, encoding="utf-8")
        driver.chmod(0o644)
    proc = subprocess.run(
        [*prefix, python, str(driver), str(step), how, mode, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        preexec_fn=default_signals,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            **(env or {}),
        },
    )
    output = proc.stdout + proc.stderr
    # A late signal may cut the child's last line short: only a whole one counts.
    counted = [line.split() for line in proc.stdout.splitlines()]
    counted = [int(w[1]) for w in counted if len(w) == 2 and w[0] == "STEPS"]
    steps = counted[-1] if counted else None
    return proc.returncode, output, steps
