"""Per-merge results live in the merge in progress, and nowhere after it."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram
import mergekit_ram.integration.methods
from mergekit_ram.integration.context import current_run, merge_run


def module_containers() -> dict[tuple[str, str], int]:
    """Size of every module-level dict, list and set of the package."""
    return {
        (name, attr): len(value)
        for name, module in list(sys.modules.items())
        if name == "mergekit_ram" or name.startswith("mergekit_ram.")
        for attr, value in vars(module).items()
        if isinstance(value, (dict, list, set)) and not attr.startswith("__")
    }


def test_failed_merges_leave_nothing_behind(family_f32, tmp_path, monkeypatch):
    """Three merges that fail after planning (the statistics pass ran)."""

    failing = mock.Mock(side_effect=RuntimeError("boom"))
    config = MergeConfiguration.model_validate(family_f32.config_dict("ramplus"))
    run_merge = mergekit_ram.run_merge  # imports the API before the snapshot
    before = module_containers()
    monkeypatch.setattr(mergekit_ram.integration.methods, "ram_merge_tensor", failing)
    for attempt in range(3):
        with pytest.raises(RuntimeError, match="boom"):
            run_merge(config, str(tmp_path / f"out{attempt}"), MergeOptions(quiet=True))
        assert current_run() is None
    assert module_containers() == before


def test_a_merge_hands_its_statistics_to_the_caller(family_f32, tmp_path):
    """The merge runs in the run its caller opened (runs nest into the first)."""
    config = MergeConfiguration.model_validate(family_f32.config_dict("ramplus"))
    with merge_run() as run:
        with merge_run() as inner:
            assert inner is run and current_run() is run
        mergekit_ram.run_merge(config, str(tmp_path / "out"), MergeOptions(quiet=True))
    settings, stats, scales = run.result
    assert settings.r > 0 and set(scales) == set(stats.tasks)
    assert current_run() is None
