"""Install mergekit-ram into mergekit: integration's patches, with the model
card's RAM+ statistics section from the analysis layer handed down to them.

This is what `import mergekit_ram`, its start-up hook and every command call,
so the card is the same however a merge starts. Importing it patches nothing
and imports no mergekit.
"""

from __future__ import annotations

from typing import Any

from mergekit_ram.integration import install as integration


def _section(run: Any) -> str:
    # Lazy: the section's module imports mergekit; this module must not, and
    # nothing of ours that does is imported before the host is probed.
    from mergekit_ram.analysis.card import statistics_section

    return statistics_section(run)


def install(eager: bool = True) -> None:
    """integration.install.install, with analysis.card's statistics section
    (IncompatibleMergekit when this mergekit is not one we can install into)."""
    integration.install(eager, _section)
