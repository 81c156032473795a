"""SIGTERM and SIGHUP end a merge as Ctrl-C does.

Python turns Ctrl-C (SIGINT) into KeyboardInterrupt; `raised()` makes
SIGTERM (`timeout`, Slurm, `docker stop`) and SIGHUP (a closed terminal, a
dropped ssh session) raise `Interrupted` the same way, in the main thread,
wherever the run is. Nothing is held: the run unwinds (its staging is
removed, one line says where OUT stands) and exits with 128 + the signal's
number. A signal the caller ignores (`nohup`) stays ignored.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]


class Interrupted(SystemExit):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, exits with 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def signal_name(error: BaseException) -> str:
    """How a user knows the interruption that ended the run."""
    if isinstance(error, Interrupted):
        return signal.Signals(error.signum).name
    return "Ctrl-C"


def _raise(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


@contextmanager
def raised() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Interrupted inside the block; the previous
    handlers come back after it. Outside the main thread (where no handler
    can be installed) signals act as before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        signum: signal.signal(signum, _raise)
        for signum in HANDLED
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
