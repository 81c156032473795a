"""mergekit_ram.integration.interrupts: one handler, raising only where allowed."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mergekit_ram.integration.interrupts import Interrupted, interruptions, signal_name


@pytest.fixture(autouse=True)
def python_default_handlers():
    """Python's own handlers while a test runs: a shell that starts pytest in
    the background ignores SIGINT, which `interruptions` rightly leaves alone."""
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
        signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    }
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("held", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_held_outside_allowed_ends_the_run_with_one_line(held, capsys):
    """A signal held until the block ends is said in one line and exits with
    128 + its number (130, 143, 129), whichever it was; later ones add nothing."""
    before = signal.getsignal(held)
    steps = []
    with pytest.raises(Interrupted) as caught:
        with interruptions() as signals:
            os.kill(os.getpid(), held)
            steps.append("after the signal")  # the step still runs
            os.kill(os.getpid(), signal.SIGTERM if held != signal.SIGTERM else held)
            steps.append("after the second")
            signals.finished = "OUT holds the new merge."
    assert steps == ["after the signal", "after the second"]
    assert caught.value.code == 128 + held
    assert signal.getsignal(held) is before
    name = signal.Signals(held).name
    assert (
        capsys.readouterr().err == f"mergekit-ram: {name}: OUT holds the new merge.\n"
    )
    assert signal_name(caught.value) == name


def test_inside_allowed_raises_at_once_and_pending_ones_on_entry():
    reached = []
    with pytest.raises(Interrupted) as caught:
        with interruptions() as signals:
            with signals.allowed():
                os.kill(os.getpid(), signal.SIGTERM)
                reached.append("not reached")
    assert caught.value.code == 128 + signal.SIGTERM and not reached
    assert signal_name(caught.value) == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):
        with interruptions() as signals:
            os.kill(os.getpid(), signal.SIGINT)
            with signals.allowed():
                reached.append("not reached either")
    assert not reached


@pytest.mark.parametrize("library", ["replaces", "drops"])
@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_interruption_native_code_replaced_or_dropped_still_ends_the_block(
    library, sent
):
    """safetensors' reader, interrupted inside, turned the handler's exception
    into a ValueError (or could drop it): the block still ends as the signal."""
    wanted = KeyboardInterrupt if sent == signal.SIGINT else Interrupted
    with pytest.raises(wanted) as caught:
        with interruptions() as signals:
            with signals.allowed():
                try:
                    os.kill(os.getpid(), sent)
                except BaseException as error:
                    if library == "replaces":
                        raise ValueError("could not determine the shape") from error
    if sent != signal.SIGINT:
        assert caught.value.code == 128 + sent
    assert signal_name(caught.value) == (
        "Ctrl-C" if sent == signal.SIGINT else signal.Signals(sent).name
    )


def test_a_signal_after_a_dropped_one_interrupts_at_once():
    """Native code dropped the first Ctrl-C: the next one still stops the
    block where it lands, not at its end."""
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interruptions() as signals:
            with signals.allowed():
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                except KeyboardInterrupt:
                    pass  # dropped
                os.kill(os.getpid(), signal.SIGINT)
                reached.append("the rest of the merge")
    assert not reached


def test_ignored_signals_stay_ignored_and_threads_are_left_alone():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with interruptions():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
    seen = []

    def in_a_thread():
        with interruptions() as signals:
            seen.append(signals.interruptible)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [True]
