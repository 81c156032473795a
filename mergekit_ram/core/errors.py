"""The one exception type for bad user input, shared by every entry point."""

from __future__ import annotations


class RAMInputError(ValueError):
    """A config, model or tensor the user can fix.

    A ValueError so that Python callers can catch it as the bad-value error it
    is. The command-line entry points turn it into click's error (exit code 2,
    no traceback): mergekit_ram.integration.errors.
    """

    exit_code = 2  # what the command-line tools exit with on it

    def __init__(self, message: str) -> None:
        self.message = " ".join(message.split())  # one paragraph
        super().__init__(self.message)
