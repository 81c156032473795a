"""mergekit_ram.integration.install: what is patched is PATCHES' list, and
nothing else of mergekit's output changes (issue 35: the output-config
builder, and so transformers' warning about it, are mergekit's own)."""

from __future__ import annotations

import types

import pytest
from mergekit import merge as mergekit_merge

from mergekit_ram.integration.install import (
    PATCHES,
    IncompatibleMergekit,
    install,
    patch_run_merge,
)


def test_the_output_config_builder_is_mergekits():
    install()
    assert not hasattr(mergekit_merge._model_out_config, "__mergekit_ram__")
    assert "_model_out_config" not in " ".join(p.changes for p in PATCHES)


def test_every_patch_names_the_hook_that_would_remove_it():
    assert all(patch.missing_hook and patch.changes for patch in PATCHES)


def test_missing_run_merge_is_an_incompatible_mergekit():
    with pytest.raises(IncompatibleMergekit, match="run_merge"):
        patch_run_merge(types.ModuleType("fake_merge"))
