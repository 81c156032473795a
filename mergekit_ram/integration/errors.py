"""Our input errors as click's, for mergekit's and our command-line tools.

Core raises RAMInputError, a plain ValueError. Stock `mergekit-yaml` is a
click command that knows nothing of it, so the run_merge wrapper and our
command group re-raise it as a ClickInputError, which click prints as
`Error: ...` with exit code 2 and no traceback, and which Python callers can
still catch as RAMInputError. A method name mergekit does not know is an
UnknownMethod: the RuntimeError mergekit raises for it, printed the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from mergekit_ram.core.errors import RAMInputError, paragraphs


class ClickInputError(click.ClickException, RAMInputError):
    """A RAMInputError that click prints as `Error: ...` and exits 2 on."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(paragraphs(message))


class UnknownMethod(ClickInputError, RuntimeError):
    """`merge_method` names no method mergekit knows: the RuntimeError
    mergekit raises for it, and our input error."""


class IncompatibleMergekit(click.ClickException, RuntimeError):
    """The installed mergekit is not one this plugin can install into
    (`host.probe`): click prints it as `Error: ...` (exit 2); a RuntimeError,
    as mergekit's own error for a method it does not have. Not an input error."""

    exit_code = 2


@contextmanager
def click_errors() -> Iterator[None]:
    """A RAMInputError raised inside, as the ClickInputError click prints."""
    try:
        yield
    except click.ClickException:
        raise  # printed as it is (an OSError stays one)
    except RAMInputError as error:
        raise ClickInputError(str(error)) from error
