"""Publishing a merge into OUT: lock, stage, rename, (name, size, mtime) manifest.

OUT is the user's folder (a clone with its `.git`, notes, a mount, files
another program writes). A merge owns the files it writes and nothing else.
Everything of ours lives in one folder inside OUT, so it is on OUT's file
system and there is one lock however OUT is spelled or mounted:

    OUT/.mergekit-ram/lock            held while a run writes into OUT
    OUT/.mergekit-ram/staged/merge    mergekit writes the whole merge here
    OUT/.mergekit-ram/manifest.json   OUT's files of ours: [name, size, mtime]
    OUT/.mergekit-ram/.gitignore      `*`: git leaves this folder out

A run locks OUT, deletes leftover staging, checks, lets mergekit write into
the staging, then publishes: it makes the new manifest durable (the previous
entries that still match their file, plus the staged files), takes
config.json out of OUT, removes the previous merge's files that this one
does not write, renames each staged file into OUT (config.json last),
rewrites the manifest to this merge's files and removes the staging. A kill
leaves the old merge, the new one, or (inside the renames) a folder without
config.json whose files of ours the manifest names: the next publish removes
them. No file is taken for a merge's by its name, and our state in OUT is
untrusted input: plain names, a bounded read, no link followed.

SIGTERM (`timeout`, Slurm, `docker stop`) and SIGHUP (a closed terminal)
end a run as Ctrl-C does, wherever it is: nothing is held, so it unwinds
(staging removed, one line saying where OUT stands) and exits with 128 + the
signal's number. A signal the caller ignores (`nohup`) stays ignored.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import click
from filelock import FileLock, Timeout
from safetensors import SafetensorError

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import WEIGHT_FILES

STATE, MANIFEST, LOCK, CONFIG = ".mergekit-ram", "manifest.json", "lock", "config.json"
STAGED, MERGE = "staged", "merge"
FORMAT = {"format": "mergekit-ram manifest", "version": 2}
LIMIT = 16 << 20  # bytes: a manifest of ours is far smaller
# A copy (`cp -a`) onto a coarser file system truncates the mtime (ns) to its
# grain: 100 ns (NTFS, SMB), 1 µs, 1 s (ext4 with 128-byte inodes, many
# network file systems), 2 s (FAT). Such an mtime still matches its entry.
GRAINS = (1, 100, 1_000, 10**9, 2 * 10**9)
SIGNALS = [
    getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)
]
AS_IT_WAS, NEW = "is as it was", "holds the new merge"
HALF = (
    "has no config.json, so no loader takes it for a model: it holds what is "
    "left of the old merge and part of the new one. Run the merge again: it "
    "publishes the whole merge and removes the rest"
)


class OutputError(RAMInputError):
    """An output folder a merge must not write into, or one that is busy."""


class Stopped(click.ClickException, OutputError, OSError):
    """The user's environment stopped a merge (a full disk, no permission, the
    hub): an OSError still, as the error that stopped it (Python callers that
    retry on OSError keep catching it); click prints it as `Error: ...`."""

    exit_code = 2


# What the user can do about an OSError, by its errno; any other (the hub, the
# network, a missing file) is told as the library told it.
ADVICE = {
    errno.ENOSPC: "Free space on that disk",
    errno.EDQUOT: "Free space within your disk quota",
    errno.EACCES: "Give the user running the merge access to it",
    errno.EPERM: "Give the user running the merge access to it",
    errno.EROFS: "It is a read-only mount: choose an output folder on a writable one",
}


class Interrupted(SystemExit):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, exits with 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def resolve_output(out: str, role: str = "output folder") -> str:
    """The folder `out` names, symlinks and `..` resolved (a link to OUT
    stays a link: the merge lands in its target).

    Refuses, before anything is read or written, an empty path (an unset
    shell variable would otherwise merge into the current folder), a path
    that cannot be resolved (a dangling link, a loop), a path under a file
    and a file.
    `role` names the folder in the message (a report folder is checked so).
    """
    if not out:
        raise OutputError(
            f'The {role} path is empty (an unset shell variable, as in "$OUT"?). '
            "Name the folder to write into."
        )
    ancestor, rest = os.path.abspath(out), []
    while not os.path.lexists(ancestor):
        ancestor, name = os.path.split(ancestor)
        rest.insert(0, name)
    why, fix = None, "Fix the path or choose another folder."
    try:
        real = os.path.realpath(ancestor, strict=True)
    except OSError as error:  # a dangling link, a loop, no permission
        why = f"cannot be resolved ({error.strerror}: {ancestor})"
    else:
        if not os.path.isdir(real) and rest:
            why = f"lies under {ancestor}, which is a file"
            fix = "Choose a folder whose parents are folders."
        elif not os.path.isdir(real):
            why = "is a file, not a folder"
            fix = "Choose a folder (a new one, or one a previous merge wrote)."
    if why is not None:
        raise OutputError(f"The {role} {out} {why}. {fix}")
    return os.path.join(real, *rest)


def plain_json(path: str, limit: int) -> dict | None:
    """The JSON object in the plain file at path, or None: absent, a link, a
    folder or a FIFO (never opened), over `limit` bytes, not JSON (or nested
    too deep for the parser), not an object. For files of ours found in a
    user's folder, which may come from anywhere."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with os.fdopen(os.open(path, flags), "rb") as reader:
            data = reader.read(limit + 1)
        document = json.loads(data) if len(data) <= limit else None
    except (OSError, ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def _identity(path: str) -> tuple[int, int] | None:
    """(size, mtime) of the regular file at path (a link is not followed)."""
    with suppress(OSError):
        found = os.lstat(path)
        if stat.S_ISREG(found.st_mode):
            return found.st_size, found.st_mtime_ns
    return None


def _entry(entry: object) -> bool:
    """[name, size, mtime]: a plain name of a file directly in OUT, two ints."""
    name = entry[0] if isinstance(entry, list) and len(entry) == 3 else None
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", STATE)
        and not set(name) & set("/\\\0")
        and all(type(value) is int for value in entry[1:])
    )


def _same(target: str, name: str, size: int, mtime: int) -> bool:
    """The file `name` in OUT is as recorded (an mtime that a coarser file
    system truncated included)."""
    now = _identity(os.path.join(target, name))
    return (
        bool(now) and now[0] == size and now[1] in {mtime - mtime % g for g in GRAINS}
    )


def _recorded(target: str) -> list[tuple[str, int, int]]:
    """The manifest's entries whose file in OUT is still as recorded; a
    manifest not wholly well-formed counts as none."""
    document = plain_json(os.path.join(target, STATE, MANIFEST), LIMIT) or {}
    files = document.get("files") if FORMAT.items() <= document.items() else None
    if not isinstance(files, list) or not all(map(_entry, files)):
        return []
    return [(name, *rest) for name, *rest in files if _same(target, name, *rest)]


def _in_the_way(target: str, ours: set[str], written: set[str]) -> list[str]:
    """Weight files in OUT, neither ours nor replaced by `written`, that a
    loader would take instead of `written`'s weights. transformers looks for
    model.safetensors, its index, pytorch_model.bin, its index, in that order
    (mergekit: an index before its single file), so a file of safetensors
    is in the way of any merge, a .bin one of a .bin merge."""
    chosen = next((n for n in WEIGHT_FILES if n in written), None)
    last = 0 if chosen is None else WEIGHT_FILES.index(chosen) // 2 * 2 + 2
    kept = (n for n in WEIGHT_FILES[:last] if n not in written | ours)
    return [n for n in kept if os.path.lexists(os.path.join(target, n))]


def _stray(out: str, names: list[str]) -> OutputError:
    return OutputError(
        f"The output folder {out} holds {', '.join(names)}, which no merge into "
        "it wrote (or which changed since): beside this merge's weights a loader "
        "would take that instead. Nothing was published. Move it out of the "
        "folder (or choose another output folder), then run the merge again."
    )


def _fsync(path: str) -> None:
    """Make a file's data, or a folder's entries, durable (not Windows' folders)."""
    if os.name != "nt" or not os.path.isdir(path):
        handle = os.open(path, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _write_manifest(target: str, entries: list) -> None:
    """Write the manifest durably (through the staging, fsynced, renamed
    into place) and a `.gitignore` of `*`: a git clone leaves our folder out."""
    state = os.path.join(target, STATE)
    for name, text in (
        (MANIFEST, json.dumps({**FORMAT, "files": entries})),
        (".gitignore", "*\n"),
    ):
        with open(os.path.join(state, STAGED, name), "w", encoding="utf-8") as handle:
            handle.write(text)
        _fsync(os.path.join(state, STAGED, name))
        os.replace(os.path.join(state, STAGED, name), os.path.join(state, name))
    _fsync(state)


def _publish(target: str, out: str, ours: list, progress: dict) -> None:
    """Move the staged merge into OUT (see the module's docstring)."""
    merge = os.path.join(target, STATE, STAGED, MERGE)
    names = sorted(os.listdir(merge), key=lambda name: name == CONFIG)
    written = {name: _identity(os.path.join(merge, name)) for name in names}
    for name in names:
        where = os.path.join(target, name)
        if os.path.isdir(where) and not os.path.islink(where) or not written[name]:
            raise OutputError(
                f"The output folder {out} holds a folder named {name}, where the "
                "merge writes a file (or mergekit wrote a folder there). Move "
                "it away, or choose another output folder."
            )
    stray = _in_the_way(target, {name for name, *_ in ours}, set(names))
    if stray:
        raise _stray(out, stray)
    for name in names:
        _fsync(os.path.join(merge, name))
    _write_manifest(target, ours + [(name, *written[name]) for name in names])
    config = os.path.join(target, CONFIG)
    progress.update(before=_identity(config), written=written)
    if CONFIG in written and os.path.lexists(config):
        os.unlink(config)  # OUT loads as no model until the new one is in
    for name, *identity in ours:
        if name not in written and _same(target, name, *identity):
            os.unlink(os.path.join(target, name))
    for name in names:
        os.replace(os.path.join(merge, name), os.path.join(target, name))
    _fsync(target)
    _write_manifest(target, [(name, *written[name]) for name in names])


def _where(target: str, progress: dict) -> str:
    """Where OUT stands, read from OUT: config.json goes out first and comes
    in last; a file of the new merge in OUT means the renames began."""
    written = progress.get("written", {})
    now = _identity(os.path.join(target, CONFIG))
    if now is not None and now == written.get(CONFIG):
        return NEW
    moved = any(_identity(os.path.join(target, n)) == i for n, i in written.items())
    return HALF if moved or now != progress.get("before", now) else AS_IT_WAS


def _clear(path: str) -> None:
    """Remove leftover staging: a link is unlinked, never followed (nor are
    links inside: shutil.rmtree unlinks them)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


@contextmanager
def _locked(target: str, out: str) -> Iterator[None]:
    """Hold OUT/.mergekit-ram/lock (the OS drops it when the holder dies);
    busy fails at once. Our folder as a link is refused: the staging inside
    it is removed, never through a link. On the way out the lock file goes
    while still held, our folder too if nothing is left."""
    state, lock = os.path.join(target, STATE), os.path.join(target, STATE, LOCK)
    with suppress(FileExistsError):
        os.mkdir(state)
    if not stat.S_ISDIR(os.lstat(state).st_mode):
        raise OutputError(
            f"The output folder {out} holds {state}, which mergekit-ram did not "
            "make (a link or not a folder). Remove it, then run the merge again."
        )
    try:
        held = FileLock(lock, blocking=False).acquire()
    except Timeout as error:
        raise OutputError(
            f"Another merge is writing into {out} right now (it holds {lock}). "
            "Wait for it to finish, or choose another output folder."
        ) from error
    with held:
        try:
            yield
        finally:
            for remove, path in ((os.unlink, lock), (os.rmdir, state)):
                with suppress(OSError):
                    remove(path)


@contextmanager
def _signals() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt, SIGTERM and SIGHUP Interrupted, in
    the main thread (elsewhere no handler can be set). The first signal
    names the exit: later ones are ignored while the run unwinds, and after
    SIGTERM / SIGHUP while the process ends. Ignored signals stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: object) -> None:
        for handled in previous:
            signal.signal(handled, signal.SIG_IGN)
        raise KeyboardInterrupt if signum == signal.SIGINT else Interrupted(signum)

    previous = {
        signum: signal.signal(signum, interrupt)
        for signum in SIGNALS
        if signal.getsignal(signum) not in (signal.SIG_IGN, None)
    }
    ending = False
    try:
        yield
    except Interrupted:
        ending = True
        raise
    finally:
        for signum, handler in previous.items():
            if not ending or signum == signal.SIGINT:
                signal.signal(signum, handler)


def _stopped(error: OSError, out: str, where: str) -> Stopped:
    """The OSError that stopped a merge, with what to do about it."""
    if error.strerror:
        reason = error.strerror + (f" ({error.filename})" if error.filename else "")
    else:
        reason = " ".join(str(error).split()) or type(error).__name__
    advice = ADVICE.get(error.errno) or (
        "Fix what it says (a model's name or revision, access to a gated model, "
        "the network, offline mode)"
    )
    stopped = Stopped(
        f"The merge into {out} stopped: {reason}; {out} {where}. {advice}, then "
        "run the merge again."
    )
    stopped.errno, stopped.filename = error.errno, error.filename
    return stopped


def staged_merge(
    out_path: str,
    write: Callable[[str], object],
    check: Callable[[], object] = lambda: None,
) -> None:
    """Run `write(staged_folder)`, then publish what it wrote into `out_path`.

    Under OUT's lock: leftover staging removed, `check()`, a weight file in
    the way of every layout refused, write, publish. Whatever fails, the
    staging goes, folders this run made go while empty, and one line or
    error says where OUT stands: a RAMInputError as it is, the environment
    (an OSError: the disk, permissions, the hub) as a Stopped naming its
    reason and fix; anything else (Ctrl-C, SIGTERM, SIGHUP, a bug) after one
    line, as it is.
    """
    target = resolve_output(out_path)
    staging = os.path.join(target, STATE, STAGED)
    made, progress, parent = [], {}, target
    while not os.path.lexists(parent):  # removed again if the run fails
        made.append(parent)
        parent = os.path.dirname(parent)
    with _signals():
        try:
            os.makedirs(target, exist_ok=True)
            with _locked(target, out_path):
                _clear(staging)
                check()
                ours = _recorded(target)
                names = {name for name, *_ in ours}
                strays = [_in_the_way(target, names, {n}) for n in WEIGHT_FILES]
                if all(strays):
                    raise _stray(out_path, sorted(set().union(*strays)))
                try:
                    os.makedirs(os.path.join(staging, MERGE))
                    write(os.path.join(staging, MERGE))
                    _publish(target, out_path, ours, progress)
                finally:
                    _clear(staging)
        except BaseException as error:
            where = _where(target, progress)
            for folder in made:
                with suppress(OSError):
                    os.rmdir(folder)
            if isinstance(error, RAMInputError):
                raise  # the user's input: it says so already
            cause = error  # kept as the cause: the traceback shows what failed
            written = re.search(r"I/O error: (.*) \(os error (\d+)\)", str(error))
            if isinstance(error, SafetensorError) and written:  # its writer's OSError
                error = OSError(int(written[2]), written[1])
            if isinstance(error, OSError):  # the user's environment
                raise _stopped(error, out_path, where) from cause
            if isinstance(error, KeyboardInterrupt):
                said = "Ctrl-C"
            elif isinstance(error, Interrupted):
                said = signal.Signals(error.signum).name
            elif isinstance(error, Exception):  # a bug of ours: its traceback follows
                said = "the merge stopped"
            else:
                raise
            print(f"mergekit-ram: {said}: {out_path} {where}.", file=sys.stderr)
            raise
