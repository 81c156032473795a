"""The contract with mergekit: every relied-on name is probed, and a change to
any of them is named in one IncompatibleMergekit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mergekit.card import generate_card
from mergekit.plan import MergePlanner

from mergekit_ram.integration.errors import IncompatibleMergekit
from mergekit_ram.integration.host import CONTRACT, SUPPORTED, probe, resolve

DOCS = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"


def test_the_installed_mergekit_keeps_the_contract():
    probe()


def owner_and_name(path: str) -> tuple[object, str]:
    owner, _, last = path.replace(":", ":.").rpartition(".")
    return resolve(owner), last


def changed() -> None:
    """Host code that no longer names anything we rely on."""


@pytest.mark.parametrize("reliance", CONTRACT, ids=lambda r: r.name)
def test_each_name_renamed_is_refused_naming_it(reliance, monkeypatch):
    """Renamed as a release would: gone from its owner, and gone from the host
    code that must reach it."""
    owner, name = owner_and_name(reliance.name)
    monkeypatch.delattr(owner, name, raising=False)
    for caller in reliance.reached.split():
        monkeypatch.setattr(*owner_and_name(caller), changed)
    with pytest.raises(IncompatibleMergekit) as error:
        probe()
    message = error.value.message
    assert message.startswith("mergekit-ram cannot install into mergekit ")
    assert reliance.name.replace(":", ".") in message and SUPPORTED in message
    assert "MERGEKIT_RAM_AUTOLOAD=0" in message


@pytest.mark.parametrize(
    "reliance", [r for r in CONTRACT if r.reads], ids=lambda r: r.name
)
def test_a_parameter_we_pass_or_read_renamed_is_refused(reliance, monkeypatch):
    monkeypatch.setattr(*owner_and_name(reliance.name), changed)
    with pytest.raises(IncompatibleMergekit, match="has no parameter"):
        probe()


@pytest.mark.parametrize(
    "reliance", [r for r in CONTRACT if r.reached], ids=lambda r: r.name
)
def test_an_override_no_longer_reached_is_refused(reliance, monkeypatch):
    """The name is still there, but the host code that called it does not."""
    monkeypatch.setattr(*owner_and_name(reliance.reached.split()[0]), changed)
    with pytest.raises(IncompatibleMergekit, match="is no longer used by"):
        probe()


def test_a_keyword_mergekit_adds_is_kept(monkeypatch):
    """New parameters of what we wrap are passed through, not refused."""
    owner, name = owner_and_name("mergekit.merge:run_merge")
    original = getattr(owner, name)

    def run_merge(merge_config, out_path, options, config_source=None, trace=False):
        """mergekit's with a new keyword; it still plans and writes the card."""
        MergePlanner.plan_to_disk, generate_card  # noqa: B018
        return original(merge_config, out_path, options, config_source)

    monkeypatch.setattr(owner, name, run_merge)
    probe()


def test_the_docs_table_lists_the_contract():
    rows = re.findall(r"^\| `([^`]+)` \|", DOCS.read_text("utf-8"), re.M)
    assert rows == [r.name.replace(":", ".") for r in CONTRACT]
