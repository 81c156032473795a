"""mergekit_ram.integration.output_folder: swap, lock and cleanup, alone.

Issue findings 2-5 and 11 at the level of the output folder; the whole
merges that reproduce them are in test_integration_publishing_swap.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from mergekit_ram.integration.output_folder import (
    OutputError,
    check_output,
    locked,
    replaced_names,
    staged_merge,
)


def test_replaced_names_only_what_a_merge_wrote():
    user = {"README.md", "notes.txt", "model.safetensors", "config.json"}
    # No previous merge: only what the new merge overwrites by name.
    assert replaced_names(user, {"config.json", "model.safetensors"}) == [
        "config.json",
        "model.safetensors",
    ]
    previous = {"mergekit_config.yml", "model-00001-of-00002.safetensors", *user}
    moved = replaced_names(previous, {"config.json", "model.safetensors"})
    assert moved[0] == "config.json"  # first: OUT never pairs old config, new weights
    assert "README.md" not in moved and "notes.txt" not in moved
    assert {"mergekit_config.yml", "model-00001-of-00002.safetensors"} <= set(moved)


def test_lock_is_exclusive_and_removed(tmp_path):
    out = str(tmp_path / "out")
    with locked(out):
        with pytest.raises(OutputError, match="Another merge"):
            with locked(out):
                pass
    assert os.listdir(tmp_path) == []
    with locked(out):  # free again
        pass


def test_sigterm_handler_is_restored(tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    staged_merge(str(tmp_path / "out"), lambda staged: None)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_failed_merge_into_a_new_folder_leaves_no_folder(tmp_path):
    out = tmp_path / "new" / "deeper" / "out"

    def fail(staged: str) -> None:
        Path(staged, "model-1.safetensors").write_text("partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        staged_merge(str(out), fail)
    assert os.listdir(tmp_path) == []


def test_foreign_weights_in_out_are_refused(tmp_path):
    (tmp_path / "model.safetensors").write_text("someone's model")
    with pytest.raises(OutputError, match="no mergekit_config.yml"):
        check_output(str(tmp_path))
