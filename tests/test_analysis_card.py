"""mergekit_ram.analysis.card: the model card's RAM+ statistics section, its
columns and legend (issue 18), its rule, verdict and repository address
(issue 30), on docs/spec.md's worked example."""

from __future__ import annotations

import pytest
import torch

from mergekit_ram.analysis.card import card_section
from mergekit_ram.core.counting import OverlapStatistics
from mergekit_ram.core.rule import MergeSettings, SurvivalTally
from mergekit_ram.integration import card as results


def worked_example(inner_products: bool = False) -> OverlapStatistics:
    """docs/spec.md's worked example: C = [3, 3, 2] of 8, U = [1, 1, 1]."""
    taus = {
        "t1": [0.5, 0, 0.2, 0, 0, 0.3, 5e-6, 0],
        "t2": [0, 0.4, 0.4, 0, 0, -0.1, 0, 0],
        "t3": [0, 0, 0.6, 0.7, 0, 0, 0, 1e-6],
    }
    stats = OverlapStatistics(epsilon=1e-5, inner_products=inner_products)
    stats.add("w", torch.zeros(8), {t: torch.tensor(v) for t, v in taus.items()})
    return stats


def card(saturation="clip", inner_products=False, tally=None) -> str:
    """The card section for the worked example under the paper's r and alpha."""
    stats = worked_example(inner_products)
    rule = dict(r=0.1, alpha=2.0, saturation=saturation, statistics="global")
    settings = MergeSettings(epsilon=1e-5, **rule)
    return card_section(settings, stats, stats.scales(settings.rule), tally)


def test_card_section_says_what_each_number_is():
    tally = SurvivalTally()
    tally.add("t1", 4, 1, "bfloat16")
    section = card(tally=tally)
    assert "pypi.org" not in section and "not on PyPI" in section
    assert "(epsilon = 1e-05, r = 0.1, clip rule, alpha = 2)" in section
    assert "| t1 | 37.50 % | 33.33 % | 66.67 % | 2.0000 | 1.2000 | 25.0 % |" in section
    assert "| t3 | 25.00 % | 50.00 % | 50.00 % | 1.0000 | 1.1000 | – |" in section
    lines = [line for line in section.splitlines() if line[:3] == "- *"]
    legend = {line.split("*")[1]: line for line in lines}
    assert "share of all the parameters" in legend["changed"]
    assert "shares of that agent's own changes" in legend["unique"]
    survives = legend["λ survives"]
    assert "written value" in survives and "differs from plain RAM" in survives
    # The soft rule, λ = 1 + r·S/C, does not use alpha (docs/spec.md).
    soft = card("soft")
    assert "(epsilon = 1e-05, r = 0.1, soft rule)" in soft
    assert "alpha" not in soft.split("|", 1)[0]


@pytest.mark.parametrize("inner_products", [False, True])
def test_card_carries_the_verdict(inner_products):
    """With the inner products (merge --report) the card's verdict names the
    agent RAM dilutes; a merge's own pass has none, and it says where to look."""
    lines = card(inner_products=inner_products).splitlines()
    (line,) = [x for x in lines if x.startswith("**Verdict:** ")]
    where = "run mergekit-ram analyze on this configuration"
    assert ("RAM would dilute" if inner_products else where) in line


def test_card_gives_the_repository_the_package_declares(monkeypatch):
    class Declared:
        def get_all(self, _name):
            return ["Documentation, https://docs.example", "Repository, https://r.ex"]

    assert "installed from a clone of its repository" in card()  # none declared
    monkeypatch.setattr(results.metadata, "metadata", lambda _name: Declared())
    assert "not on PyPI: install it from its repository, https://r.ex" in card()
