"""Failures stay honest: the user's input and environment get one `Error:`
paragraph (exit 2), a bug of ours its traceback (exit 1), from `mergekit-yaml`
as a user types it; OUT is left as it was. (For Python callers, through
`run_merge`: test_publish_merges.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import safetensors.torch
from click.testing import CliRunner
from mergekit.scripts.run_yaml import main as mergekit_yaml

import mergekit_ram

# Imported at start-up (sitecustomize on PYTHONPATH), before the merge: the
# kernel raises.
BUG = """
import mergekit_ram.core.kernel as kernel
def broken(*args, **kwargs):
    raise ZeroDivisionError("injected")
kernel.ram_merge_tensor = broken
"""


def test_a_bug_of_ours_keeps_its_traceback_and_exits_1(family_f32, tmp_path):
    """A real process: the exit code and the traceback are the interpreter's."""
    (tmp_path / "sitecustomize.py").write_text(BUG)
    (tmp_path / "config.yml").write_text(family_f32.yaml("ram"))
    out = tmp_path / "out"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [Path(sys.executable).parent / "mergekit-yaml", tmp_path / "config.yml", out],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: injected")
    assert f"mergekit-ram: the merge stopped: {out} is as it was." in result.stderr
    assert "\nError:" not in result.stderr and not out.exists()


def test_a_full_disk_is_one_error_naming_the_path_and_the_reason(
    family_f32, tmp_path, monkeypatch
):
    """mergekit-yaml as typed (in-process), with safetensors' writer failing
    as it does on a full disk (in words only): one Error paragraph with the
    fix for that cause."""

    words = "Error while serializing: I/O error: No space left on device (os error 28)"
    full = mock.Mock(side_effect=safetensors.SafetensorError(words))
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    mergekit_ram.install()
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (tmp_path / "config.yml").write_text(family_f32.yaml("ram"))
    result = CliRunner().invoke(mergekit_yaml, [str(tmp_path / "config.yml"), str(out)])
    assert result.exit_code == 2, result.output
    said = result.output[result.output.index("Error:") :].strip()
    assert said.startswith(f"Error: The merge into {out} stopped: No space left")
    assert f"{out} is as it was. Free space on that disk, then run" in said
    assert sorted(os.listdir(out)) == ["notes.txt"]
