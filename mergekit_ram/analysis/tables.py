"""The report model and its two renderings: a `Section` is a titled table
with paragraphs around it, drawn as plain text for terminals or as Markdown
for files (report.md, the model card)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def percent(part: float, whole: float, digits: int = 2) -> str:
    """`part` as a percentage of `whole`, or a dash when `whole` is 0."""
    return f"{100.0 * part / whole:.{digits}f} %" if whole else "–"


# The per-agent columns every table of ours shows (card, demo, report.md).
SHARE_HEADERS = ("changed", "unique", "shared", "ρ = S/U")


def share_cells(
    elements: int, changed: int, unique: int, shared: int, digits: int = 2
) -> list[str]:
    """An agent's changed share of all elements, its unique and shared
    shares of its changes, and ρ = S/U (∞ with shared but no unique)."""
    rho = "–" if not changed else "∞" if not unique else f"{shared / unique:.4f}"
    return [
        percent(changed, elements, digits),
        percent(unique, changed, digits),
        percent(shared, changed, digits),
        rho,
    ]


def text_table(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Aligned columns: the first left-justified, the others right-justified."""
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[Any]) -> str:
        first, *rest = [str(c) for c in cells]
        return "  ".join(
            [first.ljust(widths[0])] + [c.rjust(w) for c, w in zip(rest, widths[1:])]
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [line(headers), rule] + [line(r) for r in rows]


def markdown_table(headers: Sequence[Any], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A GitHub-flavoured Markdown table, `|` in cells escaped."""

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(headers), "|" + "---|" * len(headers)] + [line(r) for r in rows]


@dataclass(frozen=True)
class Section:
    """A titled table, `notes` after it and `intro` before it."""

    title: str
    notes: Sequence[str]
    headers: Sequence[Any]
    rows: Sequence[Sequence[Any]]
    intro: Sequence[str] = ()

    def text(self, width: int = 100) -> list[str]:
        """`title:`, the aligned table, paragraphs wrapped at `width`."""

        def wrapped(paragraphs: Sequence[str]) -> list[str]:
            return [line for p in paragraphs for line in textwrap.wrap(p, width)]

        table = text_table(self.headers, self.rows)
        return [
            "",
            self.title + ":",
            *wrapped(self.intro),
            *table,
            *wrapped(self.notes),
        ]

    def markdown(self, level: int = 2) -> list[str]:
        """A heading of `level`, then each paragraph and the table, blank-line apart."""
        lines = ["", "#" * level + " " + self.title, ""]
        for paragraph in self.intro:
            lines += [paragraph, ""]
        lines += markdown_table(self.headers, self.rows)
        for paragraph in self.notes:
            lines += ["", paragraph]
        return lines
