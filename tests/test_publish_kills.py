"""Kills at every step leave the old merge, the new one, or a folder without
config.json that the next run repairs; SIGTERM, SIGHUP and Ctrl-C remove the
staging and say where OUT stands in one line. A real child process is
interrupted at each file-system step of the protocol (faults.py); the same
with real `mergekit-yaml` is in test_publish_merges.py (slow)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from faults import (
    NEW,
    NEWER,
    OLD,
    Driver,
    default_signals,
    expected,
    failing,
    make_previous,
    ours_left,
    settled,
    sweep,
    tree,
    writer,
)

from mergekit_ram.integration.output_folder import OutputError, staged_merge


@pytest.fixture
def driver():
    started = Driver()
    yield started
    started.close()


@pytest.fixture
def memory_tmp(tmp_path):
    """A folder on tmpfs where there is one (fsync is free there, the protocol
    the same), else tmp_path: hundreds of publishes stay fast."""
    memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp_path
    folder = Path(tempfile.mkdtemp(prefix="mergekit-ram-test-", dir=memory))
    yield folder
    shutil.rmtree(folder)


def protocol_sweep(driver, folder: Path, scenario: str, every_signal: bool):
    """faults.sweep of the protocol publishing NEW over OLD and the user's
    files (or into a new folder); then a failing run and one publishing NEWER."""
    user = scenario == "previous merge"

    def fresh(name: str) -> Path:
        (folder / name).mkdir()
        return make_previous(folder / name) if user else folder / name / "out"

    code, output, steps = driver.publish(fresh("count"), 0, "SIGKILL")
    assert code == 0 and steps >= 10, output
    states = {"old": expected(OLD, folder / "old") if user else None}
    for label, files in (("new", NEW), ("newer", NEWER)):
        states[label] = expected(files, folder / label, user)

    def state(out: Path) -> str:
        found = tree(out) if out.exists() else None
        return settled(None if found == {} else found, states)

    def fail(out: Path) -> None:
        with pytest.raises(OutputError):
            staged_merge(str(out), failing)

    def publish(out):
        return staged_merge(str(out), writer(NEWER))

    run = driver.publish
    return sweep(run, steps, fresh, state, fail, publish, "newer", every_signal)


def test_interrupted_at_every_step_then_next_runs(driver, memory_tmp):
    """One signal per step, taking turns: after a kill OUT is the old merge,
    the new one, or a folder without config.json holding only files of the
    two; a signal but SIGKILL says which in one line; so is it after a
    failing run; a succeeding run leaves exactly its merge; user files byte
    for byte throughout; nothing of ours left but the manifest."""
    seen = protocol_sweep(driver, memory_tmp, "previous merge", every_signal=False)
    assert seen == {"old", "new", "half"}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["previous merge", "new folder"])
def test_every_signal_at_every_step_then_next_runs(driver, memory_tmp, scenario):
    """Also into a new folder: a kill leaves none, or the new merge."""
    seen = protocol_sweep(driver, memory_tmp, scenario, every_signal=True)
    assert {"new", "half"} <= seen


WRITING = """
import sys, time
from mergekit_ram.integration.output_folder import staged_merge
def write(staged):
    print("WRITING", flush=True)
    time.sleep(600)
staged_merge(sys.argv[1], write)
"""


def nohup() -> None:
    default_signals()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@pytest.mark.parametrize("started", [default_signals, nohup])
def test_the_first_of_two_signals_names_the_exit(previous, started):
    """SIGHUP then SIGTERM 5 ms apart (a closing terminal, then its
    session's manager): one line naming SIGHUP, exit 129, staging removed;
    under `nohup` SIGHUP stays ignored and SIGTERM ends the run."""
    before = tree(previous)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITING, str(previous)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=started,
    )
    assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    first = signal.SIGTERM if started is nohup else signal.SIGHUP
    assert proc.returncode == 128 + first, err
    assert err == f"mergekit-ram: {first.name}: {previous} is as it was.\n"
    assert tree(previous) == before and ours_left(previous) == []
