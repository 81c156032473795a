"""Paths by identity: what a folder is, not how the configuration spells it.

`./in/a`, `/abs/in/a`, `in/../in/a` and a symlink to it are one model; an
output folder is compared with the inputs the same way. Standard library
only: these checks run before any weight is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from mergekit_ram.core.weight_files import INDEX_FILES


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


def read_files(folder: str) -> list[str]:
    """The names of the files a model folder's readers open: its entries and
    every shard its weight indexes name (which may point anywhere)."""
    names = sorted(os.listdir(folder))
    for index in INDEX_FILES:
        try:
            with open(os.path.join(folder, index), encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            continue  # missing or unreadable: the header checks report it
        if isinstance(weight_map, dict):
            names += sorted({v for v in weight_map.values() if isinstance(v, str)})
    return names


def output_conflict(
    out: str, inputs: Iterable[tuple[str, str]], role: str = "output folder"
) -> str | None:
    """Why writing `out` would change an input (None when it would not).

    `out` must not be an input folder, lie inside one or hold one, and no
    file an input reads (its entries, the shards its index names) may resolve
    into `out`.
    """
    target = os.path.realpath(out)
    for input_role, path in inputs:
        if not os.path.isdir(path):
            continue
        folder = os.path.realpath(path)
        if inside(target, folder):
            where = "is" if target == folder else "lies inside"
            return f"The {role} {out} {where} the input {input_role} {path}"
        if inside(folder, target):
            return f"The input {input_role} {path} lies inside the {role} {out}"
        for name in read_files(path):
            linked = os.path.realpath(os.path.join(path, name))
            if inside(linked, target):
                return (
                    f"The input {input_role} {path} reads {name}, which resolves "
                    f"to {linked} inside the {role} {out}"
                )
    return None
