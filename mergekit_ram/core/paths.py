"""Paths by identity: what a folder is, not how the configuration spells it.

`./in/a`, `/abs/in/a`, `in/../in/a` and a symlink to it are one model; an
output folder is compared with the inputs the same way. Standard library
only: these checks run before any weight is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence


def identity(path: str) -> str:
    """A local path resolved (symlinks, `..`); a hub id as written."""
    return os.path.realpath(path) if os.path.exists(path) else path


def inside(path: str, folder: str) -> bool:
    """Whether resolved `path` is `folder` or lies below it."""
    return os.path.commonpath([path, folder]) == folder


def first_duplicate(
    entries: Sequence[tuple[str, str]],
) -> tuple[tuple[str, str], tuple[str, str]] | None:
    """The first (label, path) whose path names the same folder as an earlier one."""
    seen: dict[str, tuple[str, str]] = {}
    for label, path in entries:
        key = identity(path)
        if key in seen:
            return seen[key], (label, path)
        seen[key] = (label, path)
    return None


def output_conflict(out: str, inputs: Iterable[tuple[str, str]]) -> str | None:
    """Why writing OUT would change an input ('' / None when it would not).

    OUT must not be an input folder or lie inside one, and no file of an
    input may resolve into OUT (a symlinked checkpoint would be replaced).
    """
    target = os.path.realpath(out)
    for role, path in inputs:
        if not os.path.isdir(path):
            continue
        folder = os.path.realpath(path)
        if inside(target, folder):
            where = "is" if target == folder else "lies inside"
            return f"The output folder {out} {where} the input {role} {path}"
        for name in sorted(os.listdir(path)):
            linked = os.path.realpath(os.path.join(path, name))
            if linked != os.path.join(folder, name) and inside(linked, target):
                return (
                    f"The input {role} {path} has {name}, a link to {linked} "
                    f"inside the output folder {out}"
                )
    return None
