"""Publishing a merge into OUT, file by file, touching only the merge's files.

OUT is the user's folder: a clone with its `.git`, notes, logs, a mount, a
folder another program writes. A merge owns what it writes and nothing else,
so everything of ours lives in one folder inside OUT (same file system by
construction, one lock however OUT is spelled or mounted):

    OUT/.mergekit-ram/lock           held for the whole run
    OUT/.mergekit-ram/staged/<name>  mergekit writes the whole merge here
    OUT/.mergekit-ram/journal.json   the publish: moves and removals, in order
    OUT/.mergekit-ram/manifest.json  which files of OUT the last merge wrote
    OUT/.mergekit-ram/.gitignore     `*`: git leaves our folder out of a commit

Publishing writes the journal (made durable), then rolls it forward:
config.json out of OUT first, the previous merge's files that the new one
does not write removed, the staged files moved in, config.json last, then
the manifest written and the journal removed. A crash never leaves a folder
that loads as a model while mixed. The one recovery rule, run first by
every run into OUT under its lock: a journal present -> finish it (every
step is idempotent); staging without a journal -> delete it.

Nothing in OUT is walked, moved or deleted unless the staged merge or the
previous merge's manifest names it, and a named file is removed or replaced
only while it is still the file recorded (kind, size, mtime): our state may
come from a clone or a copy, so it is read as untrusted input (plain names,
no symlink followed, no other device entered). Standard library and
filelock only: `publishing` wraps mergekit's run_merge around it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import NamedTuple

from filelock import FileLock, Timeout

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import WRITTEN_WEIGHTS
from mergekit_ram.integration.interrupts import Interrupted, interruptions, signal_name

LOG = logging.getLogger(__name__)

STATE = ".mergekit-ram"
LOCK = "lock"
STAGED = "staged"
JOURNAL = "journal.json"
MANIFEST = "manifest.json"
GITIGNORE = ".gitignore"  # keeps our folder out of `git add -A` in a cloned OUT
TEMPORARY = ".tmp"
FORMAT = "mergekit-ram publish"
VERSION = 1
STATE_LIMIT = 16 << 20  # bytes: a journal or manifest of ours is far smaller
# Present only in a folder a merge wrote (the recipe; global RAM+ statistics).
MERGE_SIGNS = ("mergekit_config.yml", "ram_statistics.json")
MODEL_CONFIG = "config.json"  # what makes a folder load as a model
NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
# Where the OS opens a folder without following a link and moves files out of
# an open one, our staging is walked and published through open folders.
PINNED = (
    hasattr(os, "O_DIRECTORY")
    and {os.open, os.rename, os.stat, os.unlink, os.rmdir} <= os.supports_dir_fd
    and os.listdir in os.supports_fd
)
FOLDER_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
)
# (kind, size, mtime_ns): what a file of OUT was when it was recorded.
Identity = tuple[str, int, int]
KINDS = (
    (stat.S_ISREG, "file"),
    (stat.S_ISLNK, "link"),
    (stat.S_ISDIR, "folder"),
)
KIND_NAMES = {
    "file": "a file",
    "link": "a link",
    "folder": "a folder",
    "other": "a special file (a FIFO, socket or device)",
}


class OutputError(RAMInputError):
    """An output folder a merge must not write into, or one that is busy."""


def previous_merge(names: set[str]) -> bool:
    """Whether a folder holding `names` was written by a merge."""
    return bool(names.intersection(MERGE_SIGNS))


def check_output(out: str) -> None:
    """Refuse a folder with someone else's weights: the merge would mix with them."""
    names = set(os.listdir(out))
    foreign = sorted(n for n in names if WRITTEN_WEIGHTS.fullmatch(n))
    if foreign and not previous_merge(names) and not _read_manifest(out):
        raise OutputError(
            f"The output folder {out} holds model weights ({', '.join(foreign)}) "
            f"but no {MERGE_SIGNS[0]}, so no merge wrote them, and the new "
            "merge would mix its files with them. Choose a new folder, or move "
            "that model away first."
        )


# --- OUT's path ---------------------------------------------------------------


def _refuse(out: str, why: str, fix: str, role: str = "output folder") -> OutputError:
    return OutputError(f"The {role} {out} {why}. {fix}")


def resolve_output(out: str, role: str = "output folder") -> str:
    """The folder `out` names, symlinks and `..` resolved (a link to OUT
    stays a link: the merge lands in its target).

    Refuses, before anything is read or written, an empty path (an unset
    shell variable would otherwise merge into the current folder), a
    dangling symlink, a path under a file, a symlink loop and a file.
    `role` names the folder in the message (a report folder is checked so).
    """
    if not out:
        raise OutputError(
            f'The {role} path is empty (an unset shell variable, as in "$OUT"?). '
            "Name the folder to write into."
        )
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
        raise _refuse(
            out, why, "Fix the path or choose another folder.", role
        ) from error
    if rest and not os.path.isdir(real):
        raise _refuse(
            out,
            f"lies under {ancestor}, which is a file",
            "Choose a folder whose parents are folders.",
            role,
        )
    resolved = os.path.join(real, *rest)
    if not rest and not os.path.isdir(resolved):
        raise _refuse(
            out,
            "is a file, not a folder",
            "Choose a folder (a new one, or one a previous merge wrote).",
            role,
        )
    return resolved


# --- small durable steps ------------------------------------------------------


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


def _write_durably(path: str, document: dict) -> None:
    """Write JSON to path through a temporary file, renamed over it once
    durable, then make the rename durable: a reader sees all or nothing."""
    temporary = path + TEMPORARY
    with suppress(FileNotFoundError):
        os.unlink(temporary)
    data = memoryview(json.dumps(document).encode("utf-8"))
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while data:
            data = data[os.write(handle, data) :]
        os.fsync(handle)
    finally:
        os.close(handle)
    os.replace(temporary, path)
    _fsync(os.path.dirname(path))


def _identity(path: str, folder: int | None = None) -> Identity | None:
    """What the entry at path (in the open `folder`) is, never following a
    symlink (None: absent)."""
    try:
        found = os.lstat(path, dir_fd=folder)
    except FileNotFoundError:
        return None
    kind = next((k for test, k in KINDS if test(found.st_mode)), "other")
    return (kind, found.st_size, found.st_mtime_ns)


def _plain(name: object) -> bool:
    """A name of one entry directly in a folder: nothing that leads elsewhere."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", STATE)
        and not any(c in name for c in "/\\\0")
        and len(name.encode("utf-8", "surrogateescape")) <= 255
    )


def _valid_identity(value: object) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 3
        and value[0] in ("file", "link", "folder", "other")
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value[1:])
    )


def _open_folder(
    path: str, folder: int | None = None
) -> tuple[int | str, os.stat_result]:
    """A folder without following a link: (its descriptor where the OS can
    pin one, else its path; what it is). A link or anything but a folder is
    an OSError (ELOOP or ENOTDIR); `folder`: the open folder path is in."""
    if PINNED:
        opened = os.open(path, FOLDER_FLAGS, dir_fd=folder)
        return opened, os.fstat(opened)
    found = os.lstat(path)
    if not stat.S_ISDIR(found.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", path)
    return path, found


def _not_a_folder(error: OSError) -> bool:
    return error.errno in (errno.ELOOP, errno.ENOTDIR)


def _remove_tree(
    path: str, device: int, folder: int | None = None, shown: str | None = None
) -> None:
    """Remove our staging at path (in the open `folder`): links themselves,
    never their targets; a folder on another device (a mount) is left alone
    and refused. Where the OS can, folders are opened without following
    links and walked by descriptor: a link swapped in meanwhile is removed
    as a link, never walked into. `shown`: path's whole name, for messages."""
    shown = shown or path
    try:
        inner, found = _open_folder(path, folder)
    except OSError as error:
        if not _not_a_folder(error):
            raise
        os.unlink(path, dir_fd=folder)  # a file or a link: itself
        return
    try:
        if found.st_dev != device:
            raise OutputError(
                f"{shown} is a mount point inside the merge's staging folder; "
                "it was left alone. Unmount it, then run the merge again."
            )
        for name in os.listdir(inner):
            where = os.path.join(shown, name)
            if PINNED:
                _remove_tree(name, device, inner, where)
            else:
                _remove_tree(where, device)
    finally:
        if PINNED:
            os.close(inner)
    try:
        os.rmdir(path, dir_fd=folder)
    except NotADirectoryError:
        os.unlink(path, dir_fd=folder)  # swapped for a link meanwhile


def _may_replace(folder: os.stat_result, entry: os.stat_result) -> bool:
    """In a sticky folder only an entry's owner, the folder's or root may
    rename or remove it (the kernel's rule, asked before anything moves)."""
    if not folder.st_mode & stat.S_ISVTX or not hasattr(os, "geteuid"):
        return True
    return os.geteuid() in (0, entry.st_uid, folder.st_uid)


# --- the state folder: lock, manifest, journal, staging -----------------------


def plain_json(path: str, limit: int) -> dict | None:
    """The JSON object in the plain file at path, or None: absent, a link, a
    folder or a FIFO (never opened), over `limit` bytes, not JSON (or nested
    too deep for the parser), not an object. For files of ours found in a
    user's folder, which may come from anywhere."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(found.st_mode) or found.st_size > limit:
        return None
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(handle, "rb") as reader:
            document = json.loads(reader.read(limit + 1))
    except (OSError, ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def _read_state(path: str) -> dict | None:
    """A JSON document of ours at path, or None when absent or not ours
    (a symlink, a folder, too large, not JSON, another format)."""
    document = plain_json(path, STATE_LIMIT)
    if document is None or document.get("format") != FORMAT:
        return None
    return document if document.get("version") == VERSION else None


def _read_manifest(target: str) -> dict[str, Identity]:
    """The files the last merge into target wrote, as recorded (untrusted:
    only plain names with a well-formed identity count)."""
    document = _read_state(os.path.join(target, STATE, MANIFEST))
    files = document.get("files") if document else None
    if not isinstance(files, dict):
        return {}
    return {
        name: tuple(value)
        for name, value in files.items()
        if _plain(name) and _valid_identity(value)
    }


@dataclass(frozen=True)
class Journal:
    """One publish: staged files to move in (each with what it replaces) and
    previous-merge files to remove, each with the identity it must still have."""

    folder: str
    moves: tuple[tuple[str, Identity | None], ...]
    removals: tuple[tuple[str, Identity], ...]
    manifest: dict[str, Identity]

    def document(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "folder": self.folder,
            "moves": [[name, replaces] for name, replaces in self.moves],
            "removals": [[name, identity] for name, identity in self.removals],
            "manifest": self.manifest,
        }

    @classmethod
    def parse(cls, document: dict) -> Journal | None:
        """The journal a document holds, or None if any part is malformed."""
        try:
            folder = document["folder"]
            moves = [(n, None if r is None else tuple(r)) for n, r in document["moves"]]
            removals = [(n, tuple(i)) for n, i in document["removals"]]
            manifest = {n: tuple(i) for n, i in document["manifest"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        names = [folder, *(n for n, _ in moves), *(n for n, _ in removals), *manifest]
        identities = [
            *(r for _, r in moves if r is not None),
            *(i for _, i in removals),
        ]
        if not all(map(_plain, names)) or not all(
            map(_valid_identity, [*identities, *manifest.values()])
        ):
            return None
        return cls(folder, tuple(moves), tuple(removals), manifest)


class Staged(NamedTuple):
    """A staging folder: held open (`descriptor`), or by path where it cannot be."""

    path: str
    descriptor: int | None

    def identity(self, name: str) -> Identity | None:
        if self.descriptor is None:
            return _identity(os.path.join(self.path, name))
        return _identity(name, self.descriptor)

    def move(self, name: str, to: str) -> None:
        if self.descriptor is None:
            os.replace(os.path.join(self.path, name), to)
        else:
            os.replace(name, to, src_dir_fd=self.descriptor)


@dataclass(frozen=True)
class OutputState:
    """OUT and our folder inside it, for one run that holds OUT's lock."""

    target: str
    shown: str
    found: bool = False  # our folder was there before this run: a killed run's

    @property
    def root(self) -> str:
        return os.path.join(self.target, STATE)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def recover(self) -> None:
        """The one rule: a journal present is finished; staging without one
        (and our temporary files) is deleted."""
        journal_path = self.path(JOURNAL)
        if os.path.lexists(journal_path):
            document = _read_state(journal_path)
            journal = Journal.parse(document) if document else None
            if journal is None:
                raise _refuse(
                    self.shown,
                    f"holds {journal_path}, which is not a publishing journal "
                    "this version of mergekit-ram wrote (it may come from a copy "
                    "or another version); nothing was changed",
                    "If no merge is running into it, delete that file and run again.",
                )
            self._finish(journal, "an earlier run's publish")
        self.discard()

    @contextmanager
    def _staged_folder(self, journal: Journal) -> Iterator[Staged]:
        """The journal's staging folder, opened without following a link and
        held open while its files move, so that a link swapped in meanwhile
        cannot redirect a move (by path where the OS cannot pin a folder).

        Refused before anything moves unless it is what a merge into this
        folder leaves: a plain folder of OUT's file system (a clone could
        ship a link to the user's home) whose files are the ones the journal
        recorded (or already moved in).
        """
        device = os.lstat(self.root).st_dev
        path = os.path.join(self.path(STAGED), journal.folder)
        descriptor = None
        current = staging = self.path(STAGED)
        try:
            try:
                for part, current in ((staging, staging), (journal.folder, path)):
                    opened, found = _open_folder(
                        part if PINNED else current, descriptor
                    )
                    if PINNED:
                        if descriptor is not None:
                            os.close(descriptor)
                        descriptor = opened
                    if found.st_dev != device:
                        raise NotADirectoryError(errno.ENOTDIR, "elsewhere", current)
            except FileNotFoundError:
                raise self._not_ours(f"its staging {current} is missing") from None
            except OSError as error:
                if not _not_a_folder(error):
                    raise
                raise self._not_ours(
                    f"its staging {current} is a link, not a folder, or on "
                    "another file system"
                ) from None
            staged = Staged(path, descriptor)
            for name, _ in journal.moves:
                found = staged.identity(name)
                if found is not None and found != journal.manifest.get(name):
                    raise self._not_ours(
                        f"its staged {name} is not the file it recorded"
                    )
            yield staged
        finally:
            if descriptor is not None:
                os.close(descriptor)

    def _not_ours(self, reason: str) -> OutputError:
        return _refuse(
            self.shown,
            f"holds a publishing journal that no merge into this folder left "
            f"({reason}; it may come from a copy or a clone); nothing was changed",
            f"If no merge is running into it, delete {self.path(JOURNAL)} and "
            "run again.",
        )

    def staging(self) -> str:
        """A fresh folder for mergekit to write the merge into; its last name
        is OUT's, since the model card is named after it."""
        os.mkdir(self.path(STAGED), 0o755)  # nobody else may swap entries in it
        folder = os.path.basename(self.target)
        folder = folder if _plain(folder) else "merged"  # `/`, or OUT named like ours
        os.mkdir(os.path.join(self.path(STAGED), folder), 0o755)
        return os.path.join(self.path(STAGED), folder)

    def plan(self, staged: str) -> Journal:
        """The journal that publishes `staged`, checked against OUT as it is
        now: what cannot be replaced is refused before anything moves."""
        target = self.target
        folder_stat = os.stat(target)
        moves, manifest = [], {}
        for name in sorted(os.listdir(staged), key=lambda n: (n == MODEL_CONFIG, n)):
            identity = _identity(os.path.join(staged, name))
            if identity is None or identity[0] != "file" or not _plain(name):
                raise OutputError(
                    f"mergekit wrote {name!r} into the merge as something other "
                    "than a file; this version publishes files only. Please "
                    "report it with your configuration."
                )
            replaces = _identity(os.path.join(target, name))
            if replaces is not None and replaces[0] == "folder":
                raise _refuse(
                    self.shown,
                    f"holds a folder named {name}, where the merge writes a file",
                    "Move that folder away, or choose another output folder.",
                )
            self._check_replaceable(folder_stat, name)
            moves.append((name, replaces))
            manifest[name] = identity
        removals = []
        for name, identity in sorted(self.previous_files().items()):
            if name not in manifest:
                self._check_replaceable(folder_stat, name)
                removals.append((name, identity))
        return Journal(
            os.path.basename(staged), tuple(moves), tuple(removals), manifest
        )

    def _check_replaceable(self, folder: os.stat_result, name: str) -> None:
        try:
            entry = os.lstat(self.out(name))
        except FileNotFoundError:
            return
        if not _may_replace(folder, entry):
            raise _refuse(
                self.shown,
                f"is a sticky folder and its {name} belongs to another user, so "
                "this merge may not replace or remove it",
                "Ask its owner to move it away, or choose another output folder.",
            )

    def previous_files(self) -> dict[str, Identity]:
        """The files of OUT a previous merge wrote, as they are now: those its
        manifest records unchanged, and mergekit's own output names where a
        merge (stock or ours) left its signs."""
        recorded = _read_manifest(self.target)
        found = {
            name: identity
            for name, identity in recorded.items()
            if identity[0] == "file" and _identity(self.out(name)) == identity
        }
        names = os.listdir(self.target)
        if recorded or previous_merge(set(names)):
            for name in names:
                # Only a merge writes these (weights and their index included).
                if name in MERGE_SIGNS or WRITTEN_WEIGHTS.fullmatch(name):
                    identity = _identity(self.out(name))
                    if identity is not None and identity[0] == "file":
                        found[name] = identity
        return found

    def out(self, name: str) -> str:
        return os.path.join(self.target, name)

    def publish(self, staged: str) -> None:
        """Make the staged merge durable, write the journal, roll it forward."""
        journal = self.plan(staged)
        for name in journal.manifest:
            _fsync(os.path.join(staged, name))
        _fsync(staged)
        _write_durably(self.path(JOURNAL), journal.document())
        self._finish(journal, "the publish")

    def _finish(self, journal: Journal, what: str) -> None:
        """Roll the journal forward; a step the OS refuses is one message that
        says where OUT stands (the journal stays for the next run)."""
        try:
            self.roll_forward(journal)
        except OSError as error:
            folder = os.path.join(self.path(STAGED), journal.folder)
            staged = os.path.join(folder, MODEL_CONFIG)
            where = error.filename  # relative to the staging when moved from it
            if isinstance(where, str) and not os.path.isabs(where):
                where = os.path.join(folder, where)
            stopped = f"{what} stopped at {where} ({error.strerror})"
            if os.path.lexists(self.out(MODEL_CONFIG)) and not os.path.lexists(staged):
                why = f"holds the new merge, but {stopped} before it was recorded"
            else:
                why = (
                    f"is half-published: {stopped}, leaving part of the new merge "
                    "and no config.json, so it does not load as a model"
                )
            raise _refuse(
                self.shown,
                why,
                "Fix that, then run any merge into this folder again: it "
                "finishes this publish first.",
            ) from error

    def roll_forward(self, journal: Journal) -> None:
        """Finish a publish; running it again after any step does the rest.

        A file of OUT is removed or replaced only while it is exactly what
        the journal recorded; one that changed meanwhile is kept (and the
        merge's file for it dropped), with a warning naming it. The staging
        is checked first (`_staged_folder`).
        """
        ordered = sorted(journal.moves, key=lambda move: move[0] == MODEL_CONFIG)
        kept = []
        with self._staged_folder(journal) as staged:
            # config.json out first: OUT does not load as a model until the end.
            replaced = dict(journal.moves).get(MODEL_CONFIG)
            if replaced is not None and _identity(self.out(MODEL_CONFIG)) == replaced:
                if staged.identity(MODEL_CONFIG) is not None:
                    os.unlink(self.out(MODEL_CONFIG))
            for name, identity in journal.removals:
                if _identity(self.out(name)) == identity:
                    os.unlink(self.out(name))
            for name, replaces in ordered:
                if staged.identity(name) is None:
                    continue  # moved in by an earlier run of this journal
                if _identity(self.out(name)) in (None, replaces):
                    staged.move(name, self.out(name))
                else:
                    kept.append(name)
        _fsync(self.target)
        manifest = {n: i for n, i in journal.manifest.items() if n not in kept}
        document = {"format": FORMAT, "version": VERSION, "files": manifest}
        _write_durably(self.path(MANIFEST), document)
        if not os.path.lexists(self.path(GITIGNORE)):  # OUT may be a git clone
            with open(self.path(GITIGNORE), "x", encoding="utf-8") as handle:
                handle.write("# mergekit-ram's own state: never part of the model\n*\n")
        os.unlink(self.path(JOURNAL))
        _fsync(self.root)
        if kept:
            LOG.warning(
                "Kept %s in %s: changed while the merge was published, so the "
                "merge's own %s was not written there.",
                ", ".join(kept),
                self.shown,
                "file" if len(kept) == 1 else "files",
            )

    def made_by_a_killed_run(self) -> bool:
        """Whether a killed run made OUT: our folder was there before this run,
        OUT holds nothing else and no merge was published into it."""
        names = os.listdir(self.target)
        no_merge = not os.path.lexists(self.path(MANIFEST))
        return self.found and names == [STATE] and no_merge

    def discard(self) -> None:
        """Remove staging and temporary files, unless a journal still needs them."""
        if os.path.lexists(self.path(JOURNAL)):
            return
        for name in (STAGED, JOURNAL + TEMPORARY, MANIFEST + TEMPORARY):
            if os.path.lexists(self.path(name)):
                try:
                    _remove_tree(self.path(name), os.lstat(self.root).st_dev)
                except RecursionError:
                    raise _refuse(
                        self.shown,
                        f"holds {self.path(name)}, nested deeper than any merge "
                        "writes (it may come from a copy or a clone)",
                        "If no merge is running into it, remove it, then run again.",
                    ) from None


# --- the lock -------------------------------------------------------------------


@contextmanager
def locked(target: str, shown: str | None = None) -> Iterator[OutputState]:
    """Hold OUT's lock (inside OUT: one lock for the folder however it is
    spelled or mounted) for the block; busy fails at once.

    filelock's lock: flock on POSIX, LockFileEx on Windows (the OS drops
    both when the holder dies), a marker file where neither exists. On the
    way out the lock file goes while still held (filelock retries an
    unlinked one), and our folder with it when nothing else is in it.
    """
    existing = _identity(os.path.join(target, STATE))
    state = OutputState(target, shown or target, found=existing is not None)
    for path, wanted, what in (
        (state.root, "folder", "the folder mergekit-ram keeps its lock and staging in"),
        (state.path(LOCK), "file", "a lock file mergekit-ram made"),
    ):
        found = _identity(path)
        if found is not None and found[0] != wanted:
            raise _refuse(
                state.shown,
                f"holds {path}, which is {KIND_NAMES[found[0]]}, not {what}",
                "Remove it (nothing of a merge is in it), then run again.",
            )
    if existing is not None and hasattr(os, "geteuid"):
        owner = os.lstat(state.root).st_uid
        if owner != os.geteuid():
            unfinished = os.path.lexists(state.path(JOURNAL))
            raise _refuse(
                state.shown,
                f"holds {state.root}, which belongs to another user (uid "
                f"{owner}), who could redirect what this merge stages there",
                "Run any merge into it as that user: it finishes the publish "
                "that user's run left unfinished."
                if unfinished
                else "Merge as that user, or, if no merge is running into it, "
                "remove that folder (it holds no part of a published merge) "
                "and run again.",
            )
    try:
        if existing is None:
            os.mkdir(state.root, 0o755)
        lock = FileLock(state.path(LOCK), mode=0o644, blocking=False)
        lock.acquire()
    except Timeout as error:  # an OSError too: first
        raise OutputError(
            f"Another merge is writing into {state.shown} right now (it holds "
            f"{state.path(LOCK)}). Wait for it to finish, or choose another "
            "output folder."
        ) from error
    except OSError as error:
        raise _refuse(
            state.shown,
            f"does not accept new files ({error.strerror}: {error.filename})",
            "Choose a folder on a writable file system where you may create files.",
        ) from error
    try:
        yield state
    finally:
        with suppress(OSError):  # Windows keeps an open file: removed on release
            os.unlink(state.path(LOCK))
        with suppress(OSError):
            os.rmdir(state.root)  # only when nothing of ours is left in it
        lock.release()


# --- a whole run --------------------------------------------------------------


def _missing_folders(path: str) -> list[str]:
    """path and its missing parents, outermost first (made here, removed on failure)."""
    missing = []
    while path and not os.path.lexists(path):
        missing.insert(0, path)
        parent = os.path.dirname(path)
        path = parent if parent != path else ""
    return missing


def _out_of_space(error: Exception) -> bool:
    """A full disk or quota, from the OS or from a writer that says it in
    words only (safetensors' SafetensorError); never one of our own errors,
    which already say where OUT stands."""
    if isinstance(error, OutputError):
        return False
    if isinstance(error, OSError):
        return error.errno in NO_SPACE
    return any(os.strerror(code) in str(error) for code in NO_SPACE)


def _no_space(error: Exception, out: str) -> OutputError:
    where = getattr(error, "filename", None)
    return OutputError(
        f"The disk is full: writing the merge for {out} failed "
        f"({getattr(error, 'strerror', None) or os.strerror(errno.ENOSPC)}"
        f"{', ' + where if where else ''}). The output folder is "
        "as it was; free space on that file system (the merge needs about the "
        "size of one model in the output folder) or choose another folder."
    )


def staged_merge(
    out_path: str,
    write: Callable[[str], object],
    check: Callable[[], object] = lambda: None,
) -> None:
    """Run `write(staged_folder)` and publish its result into `out_path`.

    Under OUT's lock: first finish or remove what a killed run left, then
    `check()`, then write and publish. Until the publish OUT is as it was;
    this run's staging (and a folder it made for OUT) is removed whatever
    happens. Ctrl-C, SIGTERM and SIGHUP interrupt the checks and the merge
    at once and wait while publishing; after SIGKILL the next run finishes
    or removes what is left.
    """
    target = resolve_output(out_path)
    made = _missing_folders(target)
    with interruptions() as signals:
        try:
            try:
                os.makedirs(target, exist_ok=True)
            except OSError as error:
                raise _refuse(
                    out_path,
                    f"cannot be created ({error.strerror})",
                    "Choose a folder on a writable file system.",
                ) from error
            with locked(target, out_path) as state:
                state.recover()
                if not made and state.made_by_a_killed_run():
                    made = [target]  # a killed run made it: ours to remove again
                with signals.allowed():
                    check()
                check_output(target)
                try:
                    staged = state.staging()
                    with signals.allowed():
                        write(staged)
                    state.publish(staged)
                    signals.finished = (
                        f"{out_path} holds the new merge; the run stops here."
                    )
                except Exception as error:
                    if _out_of_space(error):
                        raise _no_space(error, out_path) from error
                    raise
                finally:
                    state.discard()
        except BaseException as error:
            for folder in reversed(made):
                try:
                    os.rmdir(folder)
                except OSError:
                    break
            if isinstance(error, (KeyboardInterrupt, Interrupted)):
                print(
                    f"mergekit-ram: {signal_name(error)}: the merge stopped; "
                    f"{out_path} is as it was.",
                    file=sys.stderr,
                )
            raise
