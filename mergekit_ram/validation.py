"""Checks of a RAM/RAM+ merge configuration, before any weight is read."""

from __future__ import annotations

from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions


def validate_config(config: MergeConfiguration, options: MergeOptions | None = None) -> None:
    """Raise RAMInputError for the first problem a user must fix (stub)."""
