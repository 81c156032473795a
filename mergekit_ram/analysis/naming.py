"""Names in reports: a tensor's layer (from its name alone) and short display
names for models (the report and the verdict)."""

from __future__ import annotations

import re
from collections.abc import Sequence


def layer_of(name: str) -> int | None:
    """The layer index in a tensor name (first all-digit component), or None."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else None


def labels_for(models: Sequence[str]) -> dict[str, str]:
    """Short names: last path component, or the full name where those collide."""
    short = {m: m.split("+")[0].rstrip("/").split("/")[-1] or m for m in models}
    if len(set(short.values())) < len(short):
        return {m: m for m in models}
    return short
