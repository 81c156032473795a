"""mergekit_ram.commands.install: the installer the package, its start-up hook
and the commands call hands analysis's card section down to integration's
card hook; integration's own install keeps what it was given."""

from __future__ import annotations

import importlib
from pathlib import Path

from mergekit import merge as mergekit_merge

import mergekit_ram
from mergekit_ram.analysis.card import statistics_section
from mergekit_ram.integration import install as integration
from mergekit_ram.integration.context import MergeRun


def test_the_package_installs_with_the_card_section():
    mergekit_ram.install()
    assert integration._card_section == [statistics_section]
    assert hasattr(mergekit_merge.generate_card, "__mergekit_ram__")
    # Installing again without a section keeps the one given.
    integration.install()
    assert integration._card_section == [statistics_section]


def test_a_run_without_statistics_adds_no_section():
    assert statistics_section(MergeRun()) == ""


def test_the_start_up_hook_calls_the_same_installer():
    pth = Path(__file__).resolve().parent.parent / "mergekit_ram_autoload.pth"
    assert f'activate("{mergekit_ram._INSTALLER}")' in pth.read_text(encoding="utf-8")
    module, _, function = mergekit_ram._INSTALLER.partition(":")
    assert getattr(importlib.import_module(module), function) is mergekit_ram.install
