"""Ctrl-C, SIGTERM and SIGHUP during a merge: at once while merging, later
while publishing.

Python runs signal handlers in the main thread between two bytecodes, even
when the kernel delivered the signal to another thread (mergekit's executor
has several), and a moment after it arrived. Masking the main thread alone
therefore does not keep a handler from raising between two publishing
steps, and installing a handler around each step leaves gaps between them.
`interruptions` installs one handler for the whole run: it raises only
inside `allowed()` blocks (the merge itself) and otherwise records the
signal, which ends the run once the block is over: one line on stderr and
exit status 128 + the signal's number, never a traceback. SIGHUP (a closed
terminal, a dropped ssh session) is held like the others. Standard library
only.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

HANDLED = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP")
    if hasattr(signal, name)
)


class Interrupted(SystemExit):
    """A signal that ends a merge: unwinds like Ctrl-C, exits with 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def _interruption(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def signal_name(error: BaseException) -> str:
    """How a user knows the interruption that ended the run."""
    if isinstance(error, Interrupted):
        return signal.Signals(error.signum).name
    return "Ctrl-C" if isinstance(error, KeyboardInterrupt) else type(error).__name__


class Interruptions:
    """The run's signal state: interruptible or not, what is pending, and
    what to say if a held signal ends the run after the block."""

    def __init__(self) -> None:
        self.interruptible = False
        self.pending: int | None = None
        self.raised: int | None = None
        self.finished = "the run stops here."

    def handle(self, signum: int, _frame: object) -> None:
        if self.interruptible:  # again too: native code may have dropped one
            self.raised = signum
            raise _interruption(signum)
        if self.pending is None:
            self.pending = signum

    @contextmanager
    def allowed(self) -> Iterator[None]:
        """A block that these signals interrupt at once (pending ones too).

        Native code the handler raised inside (safetensors' reader) may
        replace the interruption with an error of its own, or drop it: the
        signal still ends the block as itself.
        """
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise _interruption(signum)
        self.interruptible = True
        self.raised = None
        try:
            yield
        except BaseException as error:
            if self.raised is None or isinstance(
                error, (KeyboardInterrupt, Interrupted)
            ):
                raise
            raise _interruption(self.raised) from error
        finally:
            self.interruptible = False
        if self.raised is not None:
            raise _interruption(self.raised)


@contextmanager
def interruptions() -> Iterator[Interruptions]:
    """Hold the handled signals for the block except inside `allowed()`; one
    held until the block ends is reported (`finished`) and ends the run with
    Interrupted (exit 130, 143 or 129). The previous handlers are restored
    first. Outside the main thread no handler can be installed: signals act
    as before.
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
        name = signal.Signals(state.pending).name
        print(f"mergekit-ram: {name}: {state.finished}", file=sys.stderr, flush=True)
        raise Interrupted(state.pending)
