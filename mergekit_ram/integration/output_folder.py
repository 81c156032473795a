"""An output folder that changes only once a merge has fully succeeded.

The merge is written into a private staging folder next to OUT (same file
system, unique per process, its last component OUT's name so the model card
is unchanged). Only after it finished are the files a previous merge wrote
moved aside, the new ones moved in (config.json last) and the old ones
deleted; a failure during that swap puts the old files back, and a journal
lets the next run into OUT undo a swap that SIGKILL interrupted. Anything
that goes wrong before leaves OUT byte for byte as it was. One writer per
OUT: a lock file next to OUT, taken without waiting. SIGTERM unwinds like
Ctrl-C. Standard library only: `publishing` wraps mergekit's run_merge
around it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mergekit_ram.core.weight_files import INDEX_FILES

# Files that make a folder look like a finished merge, in publishing order
# (after the shards): the weight index, ..., config.json (what loaders need).
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
STAGING_TAG = ".mergekit-ram-"
LOCK_SUFFIX = ".mergekit-ram.lock"
JOURNAL = ".swap.json"


class OutputError(ValueError):
    """An output folder a merge must not write into, or one that is busy."""


class Terminated(SystemExit):
    """SIGTERM during a merge: unwinds like Ctrl-C, exits with 128 + 15."""


def _staging_prefix(out: str) -> str:
    parent, name = os.path.split(out)
    return os.path.join(parent, f".{name}{STAGING_TAG}")


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
    foreign = sorted(n for n in names if WEIGHTS.fullmatch(n))
    if foreign and not previous_merge(names):
        raise OutputError(
            f"The output folder {out} holds model weights ({', '.join(foreign)}) "
            f"but no {MERGE_SIGNS[0]}, so no merge wrote them, and the new "
            "merge would mix its files with them. Choose a new folder, or move "
            "that model away first."
        )


@contextmanager
def locked(out: str) -> Iterator[None]:
    """Hold OUT's lock file (next to OUT) for the block; busy fails at once."""
    parent, name = os.path.split(out)
    path = os.path.join(parent, f".{name}{LOCK_SUFFIX}")
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(handle)
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise OutputError(
                f"Another merge is writing into {out} right now (it holds "
                f"{path}). Wait for it to finish, or choose another output folder."
            ) from error
        try:
            same = os.path.samestat(os.fstat(handle), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(handle)  # the holder removed it as we opened it: take the new one
    try:
        yield
    finally:
        os.unlink(path)
        os.close(handle)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises Terminated in the block (main thread only), so that
    cleanup runs as for Ctrl-C; the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block (the swap and its undo) is done."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass
class Swap:
    """What publishing moved, so that a failure half-way can undo it."""

    out: str
    aside: str
    moved_aside: list[str] = field(default_factory=list)
    moved_in: list[str] = field(default_factory=list)

    def undo(self) -> None:
        """Take the new files out of OUT and put the old ones back."""
        for name in reversed(self.moved_in):
            path = os.path.join(self.out, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        for name in reversed(self.moved_aside):
            os.replace(os.path.join(self.aside, name), os.path.join(self.out, name))


def _publishing_order(name: str) -> int:
    return MARKERS.index(name) if name in MARKERS else -1


def replaced_names(existing: set[str], new: set[str]) -> list[str]:
    """The files of OUT a publish moves aside: what the new merge overwrites,
    and a previous merge's markers and weights it does not (config.json
    first, so OUT never pairs an old config with new weights)."""
    stale = set()
    if previous_merge(existing):  # a user's README.md only when a card replaces it
        stale = {
            n
            for n in existing
            if (n in MARKERS and n != "README.md") or WEIGHTS.fullmatch(n)
        }
    chosen = (existing & new) | stale
    return sorted(chosen, key=_publishing_order, reverse=True)


def publish(staged: str, out: str, aside: str) -> None:
    """Swap the finished merge in `staged` into OUT; on failure OUT is restored.

    A journal next to `aside` lists what the swap moves, so that a run killed
    half-way is rolled back by the next run into OUT (`recover`).
    """
    if not os.path.isdir(out):
        os.rename(staged, out)
        return
    new = sorted(os.listdir(staged), key=_publishing_order)
    swap = Swap(out, aside)
    replaced = replaced_names(set(os.listdir(out)), set(new))
    os.makedirs(aside)
    with open(f"{aside}{JOURNAL}", "w", encoding="utf-8") as handle:
        json.dump({"aside": replaced, "new": new}, handle)
    try:
        for name in replaced:
            os.replace(os.path.join(out, name), os.path.join(aside, name))
            swap.moved_aside.append(name)
        for name in new:
            os.replace(os.path.join(staged, name), os.path.join(out, name))
            swap.moved_in.append(name)
    except BaseException:
        swap.undo()
        raise


def recover(out: str, root: str) -> None:
    """Undo the swap a killed run into OUT left half done; drop its staging."""
    staged = os.path.join(root, os.path.basename(out))
    aside = os.path.join(root, f".{os.path.basename(out)}.previous")
    try:
        with open(f"{aside}{JOURNAL}", encoding="utf-8") as handle:
            journal = json.load(handle)
    except (OSError, ValueError):
        journal = None  # killed before the swap: OUT was never touched
    if journal is not None:
        swap = Swap(out, aside)
        swap.moved_in = [
            n
            for n in journal["new"]
            if os.path.lexists(os.path.join(out, n))
            and not os.path.lexists(os.path.join(staged, n))
        ]
        swap.moved_aside = [
            n for n in journal["aside"] if os.path.lexists(os.path.join(aside, n))
        ]
        swap.undo()
    shutil.rmtree(root, ignore_errors=True)


def _recover_stale_staging(out: str, keep: str) -> None:
    """What killed runs into OUT left (we hold OUT's lock, so they are dead)."""
    parent = os.path.dirname(out)
    prefix = os.path.basename(_staging_prefix(out))
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if name.startswith(prefix) and path != keep and os.path.isdir(path):
            recover(out, path)


def _created_parents(out: str) -> list[str]:
    """OUT's missing parent folders, outermost first (made here, removed on failure)."""
    missing = []
    parent = os.path.dirname(out)
    while parent and not os.path.exists(parent):
        missing.insert(0, parent)
        parent = os.path.dirname(parent)
    return missing


def staged_merge(out_path: str, write: Callable[[str], object]) -> None:
    """Run `write(staged_folder)` and publish its result into `out_path`.

    Until `write` returned and the swap succeeded, `out_path` is left as it
    was; the staging folder (and any folder made for it) is removed whatever
    happens, Ctrl-C and SIGTERM included.
    """
    out = os.path.abspath(out_path)
    made = _created_parents(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    root = f"{_staging_prefix(out)}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with sigterm_unwinds(), locked(out):
            _recover_stale_staging(out, keep=root)
            check_output(out)
            name = os.path.basename(out)
            staged = os.path.join(root, name)
            os.makedirs(staged)
            try:
                write(staged)
                with signals_held():
                    publish(staged, out, os.path.join(root, f".{name}.previous"))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    except BaseException:
        for folder in reversed(made):
            try:
                os.rmdir(folder)
            except OSError:
                break
        raise
