"""Kills at every step leave the old merge, the new one, or a folder without
config.json that the next run repairs; SIGTERM, SIGHUP and Ctrl-C remove the
staging and say where OUT stands in one line. A real child process is
interrupted at each file-system step of the protocol (faults.py); the same
with real `mergekit-yaml` is in test_publish_merges.py (slow)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
from faults import (
    EXITS,
    NEW,
    NEWER,
    OLD,
    SIGNALS,
    STATE,
    USER,
    check_exit,
    default_signals,
    expected,
    failing,
    make_previous,
    ours_left,
    run_protocol,
    tree,
    writer,
    writing,
)

from mergekit_ram.integration.output_folder import OutputError, staged_merge


def make_out(root: Path, scenario: str) -> Path:
    root.mkdir(parents=True)
    return make_previous(root) if scenario == "previous merge" else root / "out"


@pytest.fixture
def memory_tmp(tmp_path):
    """A folder on tmpfs where there is one (fsync is free there, the protocol
    the same), else tmp_path: hundreds of publishes stay fast."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="mergekit-ram-test-", dir="/dev/shm"))
    yield folder
    for path in folder.rglob("*"):  # the user's read-only file
        if not path.is_symlink():
            path.chmod(0o755)
    shutil.rmtree(folder)


def settled(state: dict | None, states: dict) -> str:
    """Which state OUT is in: old, new, or a folder without config.json
    holding only files of the two merges (and every user file)."""
    name = next((k for k, v in states.items() if v == state), None)
    if name is not None:
        return name
    assert state is not None and "config.json" not in state, state
    old, new = states["old"] or {}, states["new"]
    for name, value in state.items():
        if name.split(os.sep)[0] not in USER:
            assert value in (old.get(name), new.get(name)), name
    assert {k: v for k, v in state.items() if k.split(os.sep)[0] in USER} == {
        k: v for k, v in new.items() if k.split(os.sep)[0] in USER
    }
    return "half"


def sweep(folder: Path, scenario: str, every_signal: bool) -> set[str]:
    """Interrupt a run at every step (with each signal, or with one taking
    turns), then a failing run and a succeeding one; the states seen."""
    code, output, steps = run_protocol(
        folder, make_out(folder / "count", scenario), 0, "SIGKILL"
    )
    assert code == 0 and steps >= 10, output
    user = scenario == "previous merge"
    states = {"old": expected(OLD, folder / "old") if user else None}
    for label, files in (("new", NEW), ("newer", NEWER)):
        states[label] = expected(files, folder / label, user)
    seen = set()
    for step in range(1, steps + 1):
        for how in SIGNALS if every_signal else [SIGNALS[step % len(SIGNALS)]]:
            out = make_out(folder / f"{step}-{how}", scenario)
            code, output, _ = run_protocol(folder, out, step, how)
            assert code in EXITS[how], (step, how, output)
            found = tree(out) if out.exists() else None
            if found == {} and states["old"] is None:
                found = None  # a new folder made, nothing of a merge in it
            state = settled(found, states)
            seen.add(state)
            if how != "SIGKILL":
                check_exit(how, code, state, output)
            with pytest.raises(OutputError):
                staged_merge(str(out), failing)
            found = tree(out) if out.exists() else None
            after = settled(None if found == {} else found, states)
            assert after == state, (step, how)
            assert ours_left(out) == [], (step, how)
            staged_merge(str(out), writer(NEWER))
            assert tree(out) == states["newer"] and ours_left(out) == [], (step, how)
    return seen


def test_interrupted_at_every_step_then_next_runs(memory_tmp):
    """One signal per step, taking turns: after a kill OUT is the old merge,
    the new one, or a folder without config.json holding only files of the
    two; a signal but SIGKILL says which in one line; so is it after a
    failing run; a succeeding run leaves exactly its merge; user files byte
    for byte throughout; nothing of ours left but the manifest."""
    assert sweep(memory_tmp, "previous merge", every_signal=False) == {
        "old",
        "new",
        "half",
    }


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["previous merge", "new folder"])
def test_every_signal_at_every_step_then_next_runs(memory_tmp, scenario):
    assert {"new", "half"} <= sweep(memory_tmp, scenario, every_signal=True)


def test_a_users_folder_survives_a_killed_merge_and_a_failing_one(tmp_path):
    """The user made OUT (empty, mode 2770); a merge is killed while writing
    into it, the next one fails: the folder stays, as it was."""
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o2770)
    code, output, _ = run_protocol(tmp_path, out, 4, "SIGKILL")  # staged only
    assert code == -signal.SIGKILL and (out / STATE / "staged").is_dir(), output
    with pytest.raises(OutputError, match="No space left on device.* is as it was"):
        staged_merge(str(out), failing)
    assert os.listdir(out) == [] and out.stat().st_mode & 0o7777 == 0o2770


def nohup() -> None:
    default_signals()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


@pytest.mark.parametrize("started", [default_signals, nohup])
def test_the_first_of_two_signals_names_the_exit(previous, started):
    """SIGHUP then SIGTERM 5 ms apart (a closing terminal, then its
    session's manager): one line naming SIGHUP, exit 129, staging removed;
    under `nohup` SIGHUP stays ignored and SIGTERM ends the run."""
    before = tree(previous)
    proc = writing(previous, started)
    proc.send_signal(signal.SIGHUP)
    time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    first = signal.SIGTERM if started is nohup else signal.SIGHUP
    assert proc.returncode == 128 + first, err
    assert err == f"mergekit-ram: {first.name}: {previous} is as it was.\n"
    assert tree(previous) == before and ours_left(previous) == []
