"""The one exception type for bad user input, shared by every entry point."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


def paragraphs(message: str) -> str:
    """Each line of `message` as one paragraph (runs of whitespace joined):
    a message is one paragraph, a block of problems one per line."""
    lines = (" ".join(line.split()) for line in message.splitlines())
    return "\n".join(line for line in lines if line)


class RAMInputError(ValueError):
    """A config, model or tensor the user can fix.

    A ValueError so that Python callers can catch it as the bad-value error it
    is. The command-line entry points turn it into click's error (exit code 2,
    no traceback): mergekit_ram.integration.errors.
    """

    def __init__(self, message: str) -> None:
        self.message = paragraphs(message)
        super().__init__(self.message)


WARNINGS = 5  # listed in an error block; the rest are counted


class Problems:
    """Every problem and warning of one input, reported together (one Error
    block, not one problem per run): checks run inside `check()`,
    `raise_any` raises one RAMInputError listing what they found (warnings
    too), `emit` logs the warnings when there is no problem."""

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.found: list[str] = []
        self.warnings: list[str] = []

    def add(self, message: str) -> None:
        if message not in self.found:
            self.found.append(message)

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)

    def emit(self) -> None:
        """Each warning as one log line (logging: the host decides where)."""
        for message in self.warnings:
            logging.getLogger("mergekit_ram").warning(paragraphs(message))

    @contextmanager
    def check(self) -> Iterator[None]:
        """Run a check; the problem it raises is kept, and the caller goes on."""
        try:
            yield
        except RAMInputError as error:
            self.add(error.message)

    def error(self) -> RAMInputError:
        """The one error listing every problem found (there is at least one)."""
        if (count := len(self.found)) == 1 and not self.warnings:
            return RAMInputError(self.found[0])
        listed = [f"- {problem}" for problem in self.found]
        listed += [f"- warning: {warning}" for warning in self.warnings[:WARNINGS]]
        if len(self.warnings) > WARNINGS:
            listed.append(f"- and {len(self.warnings) - WARNINGS} more warnings")
        return RAMInputError(
            f"{self.subject} has {count} problem{'s' * (count > 1)}"
            f"{' (and warnings)' if self.warnings else ''}:\n" + "\n".join(listed)
        )

    def raise_any(self) -> None:
        if self.found:
            raise self.error()
