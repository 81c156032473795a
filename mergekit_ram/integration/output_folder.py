"""An output folder that is exactly the old merge or exactly the new one.

OUT is known by its identity R (symlinks and `..` resolved), so every
spelling of one folder shares its lock and its staging. A merge is written
into a staging folder S next to R (same file system; a short hashed name):

    S/owner.json         token, R, pid: proof that this package made S
    S/staged/<name>      the new merge, then the user's own files of R, linked
    S/previous           R itself, once it has been moved aside

and published by two renames of whole folders, R -> S/previous and
S/staged/<name> -> R, each made durable (fsync) before the next step. Every
state a kill can leave is repaired by one rule, applied under R's lock by
the next run into R before it does anything else: if S/previous exists and R
does not, rename S/previous back to R; then remove S. A folder is removed
only if this rule can prove it is ours (name, token, R, owner process gone).
Standard library and filelock only: `publishing` wraps mergekit's run_merge
around it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from filelock import FileLock, Timeout

from mergekit_ram.core.weight_files import INDEX_FILES
from mergekit_ram.integration.interrupts import interruptions

# Files that make a folder look like a finished merge.
MARKERS = (
    *INDEX_FILES,
    "ram_statistics.json",
    "mergekit_config.yml",
    "README.md",
    "config.json",
)
# Present only in a folder a merge wrote (the recipe; global RAM+ statistics).
MERGE_SIGNS = ("mergekit_config.yml", "ram_statistics.json")
# mergekit's TensorWriter names: model.safetensors, model-1.safetensors (not
# yet finalized), model-00001-of-00002.safetensors, the index; also .bin.
WEIGHTS = re.compile(
    r"(model|pytorch_model)(-\d+(-of-\d+)?)?\.(safetensors|bin)(\.index\.json)?"
)
TAG = ".mergekit-ram-"
STAGING = re.compile(r"\.mergekit-ram-([0-9a-f]{12})-([0-9a-f]{16})")
OWNER = "owner.json"
PREVIOUS = "previous"
STAGED = "staged"
NO_LINKS = (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK)
NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class OutputError(ValueError):
    """An output folder a merge must not write into, or one that is busy."""


def previous_merge(names: set[str]) -> bool:
    """Whether a folder holding `names` was written by a merge."""
    return bool(names.intersection(MERGE_SIGNS))


def check_output(out: str) -> None:
    """Refuse an OUT that is a file, or a folder with someone else's weights."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise OutputError(
            f"The output path {out} is a file, not a folder. Choose a folder "
            "(a new one, or one a previous merge wrote)."
        )
    names = set(os.listdir(out)) if os.path.isdir(out) else set()
    mounted = sorted(n for n in names if os.path.ismount(os.path.join(out, n)))
    if mounted:
        raise OutputError(
            f"The output folder {out} holds {mounted[0]}, a mount point: publishing "
            "moves OUT's own files into the new folder by hard links, which "
            "cannot cross file systems. Unmount it, or choose another folder."
        )
    foreign = sorted(n for n in names if WEIGHTS.fullmatch(n))
    if foreign and not previous_merge(names):
        raise OutputError(
            f"The output folder {out} holds model weights ({', '.join(foreign)}) "
            f"but no {MERGE_SIGNS[0]}, so no merge wrote them, and the new "
            "merge would mix its files with them. Choose a new folder, or move "
            "that model away first."
        )


def carried_names(existing: set[str], new: set[str]) -> list[str]:
    """The entries of OUT that the new OUT keeps: everything the new merge
    does not write, less a previous merge's markers and weights (a user's
    README.md stays unless a new model card replaces it)."""
    stale: set[str] = set()
    if previous_merge(existing):
        stale = {
            n
            for n in existing
            if (n in MARKERS and n != "README.md") or WEIGHTS.fullmatch(n)
        }
    return sorted(existing - new - stale)


# --- OUT's identity -------------------------------------------------------------


def _refuse(out: str, why: str, fix: str) -> OutputError:
    return OutputError(f"The output folder {out} {why}. {fix}")


def resolve_output(out: str) -> str:
    """OUT's identity: the folder it names, symlinks and `..` resolved.

    Refuses, before anything is read or written, what the two renames cannot
    publish into: a dangling symlink, a path under a file or a symlink loop, a
    mount point (a mount point cannot be renamed).
    """
    path = os.path.abspath(out)
    ancestor, rest = path, []
    while not os.path.lexists(ancestor):
        ancestor, name = os.path.split(ancestor)
        rest.insert(0, name)
    try:
        real = os.path.realpath(ancestor, strict=True)
    except OSError as error:
        if error.errno == errno.ELOOP:
            why = "lies under a symlink loop"
        elif error.errno == errno.ENOENT:
            why = f"is (or lies under) {ancestor}, a symlink to nothing"
        else:
            why = f"cannot be resolved ({error.strerror})"
        raise _refuse(out, why, "Fix the path or choose another folder.") from error
    if rest and not os.path.isdir(real):
        raise _refuse(
            out,
            f"lies under {ancestor}, which is a file",
            "Choose a folder whose parents are folders.",
        )
    resolved = os.path.join(real, *rest)
    if not rest and os.path.isdir(resolved) and os.path.ismount(resolved):
        raise _refuse(
            out,
            "is a mount point, and a merge publishes by renaming the output "
            "folder, which a mount point cannot be",
            f"Write into a folder inside it, e.g. {os.path.join(out, 'merged')}.",
        )
    return resolved


def _key(target: str) -> str:
    encoded = target.encode("utf-8", "surrogateescape")
    return hashlib.sha256(encoded).hexdigest()[:12]


# --- durable file-system steps ---------------------------------------------------


def _fsync(path: str) -> None:
    """Make a file's data, or a folder's entries, durable (where the OS can)."""
    if os.name == "nt" and os.path.isdir(path):
        return  # folders cannot be opened for fsync there
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(handle)


def _fsync_tree(root: str) -> None:
    """fsync every regular file and folder under root, root last."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                _fsync(path)
        _fsync(folder)


def _remove_tree(root: str) -> None:
    """Remove root and everything under it (links themselves, not targets)."""
    if not os.path.isdir(root) or os.path.islink(root):
        os.unlink(root)
        return
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            os.unlink(os.path.join(folder, name))
        for name in dirs:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                os.unlink(path)
            else:
                os.rmdir(path)
    os.rmdir(root)


def _carry(source: str, destination: str) -> None:
    """Recreate source at destination with hard links (copies where the file
    system has none): the user's files reach the new OUT without a copy."""
    mode = os.lstat(source).st_mode
    if stat.S_ISLNK(mode):
        os.symlink(os.readlink(source), destination)
    elif stat.S_ISDIR(mode):
        os.mkdir(destination)
        for name in sorted(os.listdir(source)):
            _carry(os.path.join(source, name), os.path.join(destination, name))
        os.chmod(destination, stat.S_IMODE(mode))
    else:
        try:
            os.link(source, destination)
        except OSError as error:
            if error.errno not in NO_LINKS:
                raise
            shutil.copy2(source, destination)


# --- the lock ---------------------------------------------------------------------


def lock_path(target: str) -> str:
    return os.path.join(os.path.dirname(target), f"{TAG}{_key(target)}.lock")


@contextmanager
def locked(target: str, shown: str | None = None) -> Iterator[None]:
    """Hold R's lock file (next to R) for the block; busy fails at once.

    filelock's lock: flock on POSIX, LockFileEx on Windows (the OS drops
    both when the holder dies), a marker file where neither exists (reclaimed
    from a dead holder). The file is removed while still held, so a run that
    opened it meanwhile finds it gone and does not take it.
    """
    path = lock_path(target)
    lock = FileLock(path, mode=0o644, blocking=False)
    try:
        lock.acquire()
    except Timeout as error:  # an OSError too: first
        raise OutputError(
            f"Another merge is writing into {shown or target} right now (it "
            f"holds {path}). Wait for it to finish, or choose another output "
            "folder."
        ) from error
    except OSError as error:
        raise _refuse(
            shown or target,
            f"cannot be published: its parent folder {os.path.dirname(target)} "
            f"does not accept new files ({error.strerror})",
            "A merge writes next to the output folder and renames it; choose "
            "a folder on a writable file system where you may create files.",
        ) from error
    try:
        yield
    finally:
        with suppress(OSError):  # Windows keeps an open file: removed on release
            os.unlink(path)
        lock.release()


# --- staging folders: made, proven ours, published, recovered ----------------------


def _started(pid: int) -> str | None:
    """The process's start time where the OS tells it (tells a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict) -> bool:
    """Whether a staging folder's owner may still be running.

    Asked under R's lock, which a live run into R would hold: the process
    probe is a second proof where it exists. On Windows os.kill(pid, 0) is no
    probe (it sends Ctrl-C), so the lock alone decides there.
    """
    if owner.get("host") != socket.gethostname():
        return True  # another machine's (shared file system): never ours to judge
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0 or os.name == "nt":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    recorded = owner.get("started")
    return recorded is None or _started(pid) in (None, recorded)


@dataclass(frozen=True)
class Staging:
    """One run's staging folder for the output folder `target`."""

    target: str
    root: str

    @property
    def model(self) -> str:
        """Where the merge is written (its last name is OUT's, for the card)."""
        return os.path.join(self.root, STAGED, os.path.basename(self.target))

    @property
    def previous(self) -> str:
        return os.path.join(self.root, PREVIOUS)

    @classmethod
    def create(cls, target: str) -> Staging:
        token = secrets.token_hex(8)
        root = os.path.join(os.path.dirname(target), f"{TAG}{_key(target)}-{token}")
        os.mkdir(root)
        staging = cls(target, root)
        try:
            staging._mark(token)
        except BaseException:
            staging.recover()
            raise
        return staging

    def _mark(self, token: str) -> None:
        root, target = self.root, self.target
        owner = {
            "token": token,
            "out": target,
            "pid": os.getpid(),
            "started": _started(os.getpid()),
            "host": socket.gethostname(),
        }
        marker = os.path.join(root, OWNER)
        handle = os.open(f"{marker}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(handle, json.dumps(owner).encode())
            os.fsync(handle)
        finally:
            os.close(handle)
        os.rename(f"{marker}.tmp", marker)
        os.mkdir(os.path.join(root, STAGED))
        os.mkdir(self.model)
        _fsync(root)
        _fsync(os.path.dirname(target))

    @classmethod
    def found(cls, target: str, root: str) -> Staging | None:
        """root as a staging folder of target's, if this package provably made
        it and its owner is gone (else None: it is left alone)."""
        match = STAGING.fullmatch(os.path.basename(root))
        if match is None or match.group(1) != _key(target):
            return None
        if os.path.islink(root) or not os.path.isdir(root):
            return None
        names = set(os.listdir(root))
        if names <= {f"{OWNER}.tmp"}:
            return cls(target, root)  # killed before its marker was complete
        try:
            with open(os.path.join(root, OWNER), encoding="utf-8") as handle:
                owner = json.load(handle)
        except (OSError, ValueError):
            return None
        if not isinstance(owner, dict):
            return None
        if owner.get("token") != match.group(2) or owner.get("out") != target:
            return None
        return None if _alive(owner) else cls(target, root)

    def publish(self) -> None:
        """Carry the user's files over, then the two renames, each made durable."""
        parent = os.path.dirname(self.target)
        if os.path.isdir(self.target):
            existing = set(os.listdir(self.target))
            for name in carried_names(existing, set(os.listdir(self.model))):
                _carry(os.path.join(self.target, name), os.path.join(self.model, name))
            os.chmod(self.model, stat.S_IMODE(os.stat(self.target).st_mode))
        _fsync_tree(self.model)
        _fsync(os.path.dirname(self.model))
        if os.path.isdir(self.target):
            os.rename(self.target, self.previous)
            _fsync(self.root)
            _fsync(parent)
        os.rename(self.model, self.target)
        _fsync(parent)

    def recover(self) -> None:
        """The one rule: a moved-aside OUT goes back if OUT is missing; then
        the staging folder goes (its marker last, so a kill leaves it provable)."""
        if not os.path.isdir(self.root):
            return
        if os.path.isdir(self.previous) and not os.path.lexists(self.target):
            os.rename(self.previous, self.target)
            _fsync(os.path.dirname(self.target))
        for name in (PREVIOUS, STAGED, f"{OWNER}.tmp"):
            path = os.path.join(self.root, name)
            if os.path.lexists(path):
                _remove_tree(path)
        if set(os.listdir(self.root)) <= {OWNER}:
            if os.path.lexists(os.path.join(self.root, OWNER)):
                os.unlink(os.path.join(self.root, OWNER))
            os.rmdir(self.root)


def recover_stale(target: str) -> None:
    """Repair what killed runs into target left (we hold target's lock)."""
    parent = os.path.dirname(target)
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if not name.startswith(TAG):
            continue
        staging = Staging.found(target, path)
        if staging is not None:
            staging.recover()


def _created_parents(out: str) -> list[str]:
    """OUT's missing parent folders, outermost first (made here, removed on failure)."""
    missing = []
    parent = os.path.dirname(out)
    while parent and not os.path.exists(parent):
        missing.insert(0, parent)
        parent = os.path.dirname(parent)
    return missing


def _no_space(error: OSError, out: str) -> OutputError:
    return OutputError(
        f"The disk is full: writing the merge for {out} failed ({error.strerror}"
        f"{', ' + error.filename if error.filename else ''}). The output folder is "
        "as it was; free space on that file system (the merge needs about the "
        "size of one model next to the output folder) or choose another folder."
    )


def staged_merge(
    out_path: str,
    write: Callable[[str], object],
    check: Callable[[], object] = lambda: None,
) -> None:
    """Run `write(staged_folder)` and publish its result into `out_path`.

    Under OUT's lock, first repair what killed runs left, then `check()`,
    then write and publish. Until the publish, OUT is as it was; the staging
    folder (and any parent folder made for it) is removed whatever happens,
    Ctrl-C and SIGTERM included (they interrupt the checks and the merge at
    once, and wait while publishing); after SIGKILL the next run repairs it.
    """
    target = resolve_output(out_path)
    made = _created_parents(target)
    try:
        with interruptions() as signals:
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
            except OSError as error:
                raise _refuse(
                    out_path,
                    f"cannot be created ({error.strerror})",
                    "Choose a folder on a writable file system.",
                ) from error
            with locked(target, out_path):
                recover_stale(target)
                with signals.allowed():
                    check()
                check_output(target)
                staging = None
                try:
                    staging = Staging.create(target)
                    with signals.allowed():
                        write(staging.model)
                    staging.publish()
                except OSError as error:
                    if error.errno in NO_SPACE:
                        raise _no_space(error, out_path) from error
                    raise
                finally:
                    if staging is not None:
                        staging.recover()
    except BaseException:
        for folder in reversed(made):
            try:
                os.rmdir(folder)
            except OSError:
                break
        raise
