"""Ctrl-C and SIGTERM during a merge: at once while merging, later while publishing.

Python runs signal handlers in the main thread between two bytecodes, even
when the kernel delivered the signal to another thread (mergekit's executor
has several), and a moment after it arrived. Masking the main thread alone
therefore does not keep a handler from raising between two publishing
steps, and installing a handler around each step leaves gaps between them.
`interruptions` installs one handler for the whole run: it raises only
inside `allowed()` blocks (the merge itself) and otherwise records the
signal, which is raised when the run is over. Standard library only.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Terminated(SystemExit):
    """SIGTERM during a merge: unwinds like Ctrl-C, exits with 128 + 15."""


def _interruption(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(128 + signum)


class Interruptions:
    """The run's signal state: interruptible or not, and what is pending."""

    def __init__(self) -> None:
        self.interruptible = False
        self.pending: int | None = None

    def handle(self, signum: int, _frame: object) -> None:
        if self.interruptible:
            self.interruptible = False
            raise _interruption(signum)
        if self.pending is None:
            self.pending = signum

    @contextmanager
    def allowed(self) -> Iterator[None]:
        """A block that Ctrl-C and SIGTERM interrupt at once (pending ones too)."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise _interruption(signum)
        self.interruptible = True
        try:
            yield
        finally:
            self.interruptible = False


@contextmanager
def interruptions() -> Iterator[Interruptions]:
    """Hold Ctrl-C and SIGTERM for the block except inside `allowed()`; a held
    one is raised when the block ends. The previous handlers are restored.
    Outside the main thread no handler can be installed: signals act as before.
    """
    state = Interruptions()
    if threading.current_thread() is not threading.main_thread():
        state.interruptible = True
        yield state
        return
    previous = {}
    try:
        for signum in HANDLED:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, state.handle)
        yield state
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if state.pending is not None:
        raise _interruption(state.pending)
