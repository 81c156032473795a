"""Interrupting a real process at its Nth file-system step while it publishes.

A `Driver` is one process that forks a child for each run (a run then costs
milliseconds, not an interpreter's start-up). The child replaces the `os`
module seen by mergekit_ram.integration.output_folder with a proxy counting
every mkdir, makedirs, rename, replace, link, symlink, unlink, rmdir, fsync
and write. At step N it sends itself SIGKILL, or SIGTERM / SIGINT / SIGHUP to
its main thread (odd N: to an idle thread, since a signal may land on any
thread of a merge and Python then handles it in the main thread), waits until
it is delivered (the wakeup fd), so that the step itself never runs. Step 0
never interrupts: the child prints how many steps its run took. `sweep`
interrupts runs at every step and checks what each leaves.

Also what every publishing test shares: a stand-in merge that writes a few
files, OUT holding a user's files (notes, a `.git`, a link, a read-only
file), what of ours is left in OUT.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mergekit_ram.integration.output_folder import staged_merge

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


def tree(folder: Path, present: tuple[str, ...] = ()) -> dict[str, str]:
    """Every entry under folder but our own: sha256 of files ('present' for
    those named in `present`), link targets, 'dir', a read-only mark, never
    following a link."""
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
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            found[name] = mode + ("present" if path.name in present else sha)
    return found


def writer(files: dict[str, str]):
    """A stand-in for mergekit: writes `files` into the staged folder."""
    return lambda staged: [Path(staged, n).write_text(t) for n, t in files.items()]


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


# argv: the mode ("protocol": staged_merge of [out, {name: text}], or
# "mergekit-yaml": its argv); stdin: one [step, signal, *args] per run; stdout:
# [exit code, output] per run.
DRIVER = """
import json, os, signal, sys, threading, traceback
from pathlib import Path
import mergekit_ram.integration.output_folder as folder
STEPS = (
    "mkdir", "makedirs", "rename", "replace", "link", "symlink", "unlink", "rmdir",
    "fsync", "write",
)
if sys.argv[1] == "mergekit-yaml":  # each tensor merged is a step too
    import mergekit_ram.integration.methods as methods
    from mergekit.scripts.run_yaml import main
    KERNEL = methods.ram_merge_tensor


def run(step, how, args):
    count, idle = [0], threading.Thread(target=threading.Event().wait, daemon=True)
    idle.start()
    # A Python-level handler's C half writes each signal here: reading it
    # tells that the signal was delivered, so Python handles it at its next
    # step in the main thread, whichever thread received it.
    delivered, wakeup = os.pipe()
    os.set_blocking(wakeup, False)
    signal.set_wakeup_fd(wakeup)

    def counted(real):
        def step_then(*a, **k):
            count[0] += 1
            if count[0] == step:
                if how == "SIGKILL":
                    os.kill(os.getpid(), signal.SIGKILL)
                # To the main thread, or to another one (odd steps).
                thread = idle if step % 2 else threading.main_thread()
                signal.pthread_kill(thread.ident, getattr(signal, how))
                os.read(delivered, 1)
            return real(*a, **k)

        return step_then

    class Faulty:
        def __getattr__(self, name):
            return counted(getattr(os, name)) if name in STEPS else getattr(os, name)

    folder.os = Faulty()
    try:  # exits as the interpreter would
        if sys.argv[1] == "mergekit-yaml":
            methods.ram_merge_tensor = counted(KERNEL)
            main(args)  # click exits
        out, files = args
        write = lambda staged: [Path(staged, n).write_text(files[n]) for n in files]
        folder.staged_merge(out, write)
        return 0
    except SystemExit as done:
        return done.code or 0
    except KeyboardInterrupt:  # the run printed its line: exit as a shell would
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        print("STEPS", count[0], flush=True)


for line in sys.stdin:
    step, how, *args = json.loads(line)
    output, into = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(into, 1)
        os.dup2(into, 2)
        signal.alarm(300)  # a dropped signal: killed, never a hang
        code = run(step, how, args)
        sys.stderr.flush()
        os._exit(code)
    os.close(into)
    with open(output, errors="replace") as child:
        said = child.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps([code, said]), flush=True)
"""


class Driver:
    """Runs interrupted at a step, each in a child forked by one process
    (`prefix`: e.g. setpriv, to run it as another user)."""

    def __init__(self, mode="protocol", prefix=(), env=None):
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", DRIVER, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=default_signals,
            env={**os.environ, **(env or {})},
        )

    def run(self, step: int, how: str, *args) -> tuple[int, str, int | None]:
        """(exit code, output, steps counted) of one run."""
        print(json.dumps([step, how, *args]), file=self.proc.stdin, flush=True)
        code, output = json.loads(self.proc.stdout.readline())
        # A late signal may cut the child's last line short: only a whole one counts.
        counted = [line.split() for line in output.splitlines()]
        counted = [int(w[1]) for w in counted if len(w) == 2 and w[0] == "STEPS"]
        return code, output, counted[-1] if counted else None

    def publish(self, out: Path, step: int, how: str):
        """A run of the protocol alone, publishing NEW into out."""
        return self.run(step, how, str(out), NEW)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def settled(found: dict | None, states: dict, user=USER) -> str:
    """Which state OUT is in: a name in `states` (their tree(), None: no
    OUT), or "half": a folder without config.json holding only files of the
    old and new merges, the user's (top-level names in `user`) as they were."""
    name = next((k for k, v in states.items() if v == found), None)
    if name is not None:
        return name
    assert found is not None and "config.json" not in found, found
    old, new = states["old"] or {}, states["new"]
    for name, value in found.items():
        if name.split(os.sep)[0] not in user:
            assert value in (old.get(name), new.get(name)), name
    users = [
        {k: v for k, v in t.items() if k.split(os.sep)[0] in user} for t in (found, new)
    ]
    assert users[0] == users[1], found
    return "half"


def sweep(run, steps, fresh, state, fail, succeed, final="new", every_signal=False):
    """run(fresh OUT, step, signal) interrupted at every step (with each
    signal, or with one taking turns); a signal but SIGKILL ends it with one
    line saying truly where OUT stands; then fail(OUT) leaves OUT's state(),
    succeed(OUT) leaves the `final` state; never anything of ours left. The
    set of states seen."""
    seen = set()
    for step in range(1, steps + 1):
        for how in SIGNALS if every_signal else [SIGNALS[step % len(SIGNALS)]]:
            out = fresh(f"{step}-{how}")
            code, output, _ = run(out, step, how)
            found = state(out)
            seen.add(found)
            assert code in EXITS[how], (step, how, code, output[-2000:])
            if how != "SIGKILL":
                assert SAID[found] in output, (step, how, found, output[-2000:])
                assert "Traceback" not in output, (step, how, output[-2000:])
            fail(out)
            assert state(out) == found and ours_left(out) == [], (step, how)
            succeed(out)
            assert state(out) == final and ours_left(out) == [], (step, how)
    return seen
