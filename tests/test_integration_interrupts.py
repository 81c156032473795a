"""mergekit_ram.integration.interrupts: SIGTERM and SIGHUP raise as Ctrl-C does."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mergekit_ram.integration.interrupts import Interrupted, raised, signal_name


@pytest.fixture(autouse=True)
def python_default_handlers():
    """Python's own handlers while a test runs (a shell that starts pytest in
    the background ignores some, which `raised` rightly leaves alone)."""
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
        signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    }
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGHUP])
def test_raised_at_once_and_exits_with_128_plus_the_signal(sent):
    with pytest.raises(Interrupted) as interrupted, raised():
        os.kill(os.getpid(), sent)
    assert interrupted.value.code == 128 + sent
    assert signal_name(interrupted.value) == signal.Signals(sent).name
    assert signal.getsignal(sent) is signal.SIG_DFL  # restored
    assert signal_name(KeyboardInterrupt()) == "Ctrl-C"


def test_ignored_signals_stay_ignored_and_threads_are_left_alone():
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
    with raised():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    seen = []

    def in_a_thread():
        with raised():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [signal.SIG_DFL]
