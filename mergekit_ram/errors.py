"""The one exception type for bad user input, shared by every entry point."""

from __future__ import annotations

import click


class RAMInputError(click.ClickException, ValueError):
    """A config, model or tensor the user can fix; exit code 2, no traceback.

    A ClickException so that both `mergekit-ram` and stock `mergekit-yaml`
    (click commands) print only the message and exit 2; a ValueError so that
    Python callers can catch it as the bad-value error it is.
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
