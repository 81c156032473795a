"""Interrupting a real process at its Nth file-system step while it publishes.

`run_interrupted` starts a child that replaces the `os` module seen by
mergekit_ram.integration.output_folder with a proxy counting every mkdir,
rename, link, symlink, unlink, rmdir, fsync and write. At step N the child
sends itself SIGKILL, or SIGTERM / SIGINT to an idle thread (a signal may land
on any thread of a merge, and Python handles it in the main thread a moment
later), then does the step. Step 0 never interrupts: the child prints how
many steps its publish took.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

TIMEOUT = 300
SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT")
# A signal sent to another thread is handled a moment later, possibly once the
# publish is over (exit 0) or its handlers restored (killed by the signal);
# mergekit-yaml (click) turns Ctrl-C into exit 1.
EXITS = {
    "SIGKILL": {-signal.SIGKILL},
    "SIGTERM": {128 + signal.SIGTERM, -signal.SIGTERM, 0},
    "SIGINT": {-signal.SIGINT, 1, 0},
}

DRIVER = """
import importlib.util, os, signal, sys, threading
from pathlib import Path

step, how, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
args = sys.argv[4:]
if mode == "protocol":  # output_folder alone, loaded by path: starts in a blink
    spec = importlib.util.spec_from_file_location("output_folder", args[0])
    folder = importlib.util.module_from_spec(spec)
    sys.modules["output_folder"] = folder
    spec.loader.exec_module(folder)
else:
    import mergekit_ram.integration.output_folder as folder

STEPS = ("mkdir", "rename", "link", "symlink", "unlink", "rmdir", "fsync", "write")
idle = threading.Thread(target=threading.Event().wait, daemon=True)
idle.start()


class Faulty:
    count = 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in STEPS:
            return real

        def step_then(*a, **k):
            Faulty.count += 1
            if Faulty.count == step:
                if how == "SIGKILL":
                    os.kill(os.getpid(), signal.SIGKILL)
                signal.pthread_kill(idle.ident, getattr(signal, how))
            return real(*a, **k)

        return step_then


folder.os = Faulty()
try:
    if mode == "protocol":
        out, files = args[1], args[2]

        def write(staged):
            for line in files.split(";"):
                name, text = line.split("=")
                Path(staged, name).write_text(text)

        folder.staged_merge(out, write)
    else:
        from mergekit.scripts.run_yaml import main

        main(args)
finally:
    print("STEPS", Faulty.count, flush=True)
"""


def run_interrupted(
    folder: Path, step: int, how: str, mode: str, args: list[str]
) -> tuple[int, str, int | None]:
    """(exit code, output, steps counted) of one child run."""
    driver = folder / "fault_driver.py"
    if not driver.exists():
        driver.write_text(DRIVER, encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(driver), str(step), how, mode, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        },
    )
    output = proc.stdout + proc.stderr
    # A late signal may cut the child's last line short: only a whole one counts.
    counted = [line.split() for line in proc.stdout.splitlines()]
    counted = [int(w[1]) for w in counted if len(w) == 2 and w[0] == "STEPS"]
    steps = counted[-1] if counted else None
    return proc.returncode, output, steps
