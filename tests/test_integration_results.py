"""mergekit_ram.integration.results: strict JSON (issue finding 10) and the
model card's RAM+ section and model order (issue 18)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram
from mergekit_ram.core.counting import OverlapStatistics
from mergekit_ram.core.settings import MergeSettings
from mergekit_ram.core.survival import SurvivalTally
from mergekit_ram.integration.results import card_section, strict_json


def test_report_json_is_strict():
    document = {"a": [float("inf"), 1.5], "b": {"c": float("nan")}, "d": "x"}
    text = json.dumps(strict_json(document), allow_nan=False)
    assert json.loads(text) == {"a": [None, 1.5], "b": {"c": None}, "d": "x"}
    assert math.isfinite(strict_json(2.0))


def test_card_section_says_what_each_number_is():
    """docs/spec.md's worked example: C = [3, 3, 2] of 8, U = [1, 1, 1]."""
    taus = {
        "t1": [0.5, 0, 0.2, 0, 0, 0.3, 5e-6, 0],
        "t2": [0, 0.4, 0.4, 0, 0, -0.1, 0, 0],
        "t3": [0, 0, 0.6, 0.7, 0, 0, 0, 1e-6],
    }
    stats = OverlapStatistics(epsilon=1e-5)
    stats.add("w", torch.zeros(8), {t: torch.tensor(v) for t, v in taus.items()})
    settings = MergeSettings(
        epsilon=1e-5, r=0.1, alpha=2.0, saturation="clip", statistics="global"
    )
    tally = SurvivalTally()
    tally.add("t1", 4, 1, "bfloat16")
    card = card_section(settings, stats, stats.scales(settings.rule), tally)

    assert "pypi.org" not in card and "not on PyPI" in card
    assert "| t1 | 37.50 % | 33.33 % | 66.67 % | 2.0000 | 1.2000 | 25.0 % |" in card
    assert "| t3 | 25.00 % | 50.00 % | 50.00 % | 1.0000 | 1.1000 | – |" in card
    legend = {
        line.split("*")[1]: line for line in card.splitlines() if line[:3] == "- *"
    }
    assert "share of all the parameters" in legend["changed"]
    assert "shares of that agent's own changes" in legend["unique"]
    survives = legend["λ survives"]
    assert "written value" in survives and "differs from plain RAM" in survives


def models_merged(card: str) -> list[str]:
    section = card.split("### Models Merged", 1)[1].split("###", 1)[0]
    return [line[2:] for line in section.splitlines() if line.startswith("* ")]


def statistics_rows(card: str, paths: list[str]) -> list[str]:
    section = card.split("### RAM+ statistics", 1)[1]
    cells = [line.split(" | ")[0].removeprefix("| ") for line in section.splitlines()]
    return [cell for cell in cells if cell in paths]


@pytest.mark.parametrize(
    "order", [("gamma", "alpha", "beta"), ("beta", "alpha", "gamma")]
)
def test_card_lists_models_in_config_order(order, family_f32, tmp_path):
    """mergekit lists a set (its order changes with each process's hash seed):
    one order of the same models and its reverse, which no set order matches
    both of."""
    family = family_f32
    config = family.config_dict("ramplus", tasks=order)
    out = tmp_path / "out"
    mergekit_ram.run_merge(
        MergeConfiguration.model_validate(config), str(out), MergeOptions(quiet=True)
    )
    card = (out / "README.md").read_text(encoding="utf-8")
    paths = [family.paths[name] for name in order]
    assert models_merged(card) == paths
    assert statistics_rows(card, paths) == paths
