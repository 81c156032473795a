"""mergekit_ram.core.verdict: each threshold from both sides, the sentence,
the benchmark findings it cites, and the agent it names on the two regimes of
benchmarks/agents (their stored `analyze` reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergekit_ram.core.verdict import (
    ALONE,
    BASELINES,
    FINDINGS,
    KEPT_WHOLE,
    NESTED,
    OVERLAPPING,
    SPARSE_KEPT,
    judge,
    pair_supports,
    unique_share_departure,
)

RESULTS = Path(__file__).parent.parent / "benchmarks/agents/results/results.json"
UP, DOWN = 1.001, 0.999  # just above / just below a threshold


@pytest.mark.parametrize(
    ("lift", "inside", "kind"),
    [
        (1.0, NESTED * UP, "nested"),
        (1.0, NESTED * DOWN, "independent"),
        (OVERLAPPING * UP, 0.5, "overlapping"),
        (OVERLAPPING * DOWN, 0.5, "independent"),
        (1 / OVERLAPPING * DOWN, 0.1, "disjoint"),
        (1 / OVERLAPPING * UP, 0.1, "independent"),
        (None, 0.0, "disjoint"),
        (3.0, NESTED * UP, "nested"),  # nested wins over overlapping
    ],
)
def test_pair_supports_on_both_sides_of_each_threshold(lift, inside, kind):
    assert pair_supports(lift, inside) == kind


@pytest.mark.parametrize(
    ("observed", "expected", "departure"),
    [
        (0.2, 0.2 * OVERLAPPING * UP, "below"),
        (0.2, 0.2 * OVERLAPPING * DOWN, None),
        (0.3 * OVERLAPPING * UP, 0.3, "above"),
        (0.3 * OVERLAPPING * DOWN, 0.3, None),
        (0.193, 0.188, None),  # the demo's coder: observed ≈ expected
        (None, 0.3, None),
    ],
)
def test_unique_share_departure_on_both_sides(observed, expected, departure):
    assert unique_share_departure(observed, expected) == departure


def three(kept, lift=1.0):
    """The verdict on three agents of 100 changes each whose pairs all have
    this lift (expected overlap 20), with RAM retentions `kept`."""
    overlap = 20 * lift
    matrix = [[100 if s == t else overlap for t in range(3)] for s in range(3)]
    expected = [[100 if s == t else 20 for t in range(3)] for s in range(3)]
    models = ["/m/a", "/m/b", "/m/c"]
    return judge(models, ["a", "b", "c"], [100] * 3, matrix, expected, kept)


def test_one_agent_diluted_alone_or_with_the_others():
    low = 0.6
    alone = three([low, low / ALONE * UP, 0.8])
    assert alone.diluted == ("/m/a",)
    assert "RAM would dilute a (it keeps 0.60 of its task vector" in alone.sentence
    together = three([low, low / ALONE * DOWN, 0.8])
    assert together.diluted == ("/m/a", "/m/b")
    assert "RAM would dilute a and b about equally" in together.sentence
    assert ", a most" in together.sentence
    every = three([0.68, 0.70, 0.72])
    assert every.diluted == ("/m/a", "/m/b", "/m/c")
    assert "every agent about equally (retention 0.68–0.72), a most" in every.sentence


def test_agents_kept_whole_are_not_diluted():
    kept = three([KEPT_WHOLE * UP, 0.95, 1.02])
    assert kept.diluted == ()
    assert f"RAM keeps at least {KEPT_WHOLE:g} of every agent" in kept.sentence
    # Just below, the lowest is diluted (alone: the others keep ≥ 1/ALONE more).
    below = three([KEPT_WHOLE * DOWN, 1.05, 1.1])
    assert below.diluted == ("/m/a",)


def test_without_retention_the_verdict_says_where_to_get_it():
    verdict = three(None)
    assert verdict.diluted == ()
    assert "mergekit-ram analyze" in verdict.sentence


def test_advice_follows_the_case():
    independent = three([0.6, 0.8, 0.8])
    assert independent.supports == "independent"
    assert "try `shared: ties`" in independent.sentence
    assert str(FINDINGS["heterogeneous", "shared_ties"]) in independent.sentence
    overlapping = three([0.6, 0.8, 0.8], lift=OVERLAPPING * UP)
    assert overlapping.supports == "overlapping"
    assert "`shared: ties`" in overlapping.sentence  # as a measured loss
    assert str(FINDINGS["homogeneous", "ram"]) in overlapping.sentence
    assert "try `shared: ties`" not in overlapping.sentence
    equal = three([0.7, 0.7, 0.7])
    assert "compare with tuned task arithmetic" in equal.sentence
    assert "shared: ties" not in equal.sentence


def test_mixed_supports_name_each_kind():
    # a ⊂ b (nested), a × c and b × c independent.
    intersection = [[10, 10, 2], [10, 50, 10], [2, 10, 20]]
    expected = [[10, 5, 2], [5, 50, 10], [2, 10, 20]]
    verdict = judge(
        ["a", "b", "c"], ["a", "b", "c"], [10, 50, 20], intersection, expected, None
    )
    assert verdict.supports == "nested"
    kinds = [p.supports for p in verdict.pairs]
    assert kinds == ["nested", "independent", "independent"]
    assert verdict.sentence.startswith(
        "supports mixed: nested for a × b (100 % of a's changes lie inside b's), "
        "independent for a × c and b × c (lift 1.00)"
    )


def test_one_task_model_and_nothing_changed():
    one = judge(["a"], ["a"], [5], [[5]], [[5.0]], [1.0])
    assert one.supports is None and one.pairs == () and one.diluted == ()
    assert one.sentence.startswith("one task model")
    idle = judge(
        ["a", "b"], ["a", "b"], [5, 0], [[5, 0], [0, 0]], [[5, 0], [0, 0]], None
    )
    assert idle.supports is None and "at most one task model" in idle.sentence


def regimes() -> dict:
    with open(RESULTS, encoding="utf-8") as handle:
        return json.load(handle)["regimes"]


def test_cited_findings_are_the_benchmarks():
    """FINDINGS, BASELINES and SPARSE_KEPT quote results.json (rounded as cited)."""
    found = regimes()
    for (regime, row), finding in FINDINGS.items():
        paired = found[regime]["paired"][row]
        low, high = paired["ci95"]
        assert (finding.difference, finding.low, finding.high) == tuple(
            round(100 * v, 1) for v in (paired["difference"], low, high)
        ), (regime, row)
    names = {"task_arithmetic": "task arithmetic", "dare_ties": "DARE+TIES"}
    for regime, baseline in BASELINES.items():
        assert names[found[regime]["reference"]] == baseline
    retention = found["heterogeneous"]["support"]["retention"]
    for merge, kept in SPARSE_KEPT.items():
        assert round(retention[merge]["recall"], 2) == kept


def probe_verdict(probe: dict):
    """The verdict on a stored `analyze` report (report.json), as judged by
    build_report from the same numbers."""
    tasks, pair = probe["tasks"], probe["pairwise"]
    return judge(
        [t["model"] for t in tasks],
        [t["label"] for t in tasks],
        [t["changed"] for t in tasks],
        pair["intersection"],
        pair["expected_intersection"],
        [t["retention"]["ram"] for t in tasks],
    )


@pytest.mark.parametrize(
    ("regime", "supports"),
    [("heterogeneous", "independent"), ("homogeneous", "overlapping")],
)
def test_verdict_names_the_agent_that_lost_accuracy(regime, supports):
    """On each regime's probe, the agent the verdict says RAM dilutes most is
    one whose task RAM lost most accuracy on against the best tuned
    baseline, and every such agent is named."""
    block = regimes()[regime]
    verdict = probe_verdict(block["probe"])
    assert verdict.supports == supports
    rows = block["rows"]
    loss = {
        task: rows[block["reference"]][task]["correct"] - rows["ram"][task]["correct"]
        for task in rows["ram"]
    }
    worst = {task for task, lost in loss.items() if lost == max(loss.values())}
    label = {t["model"]: t["label"] for t in block["probe"]["tasks"]}
    named = [label[m] for m in verdict.diluted]
    assert named and named[0] in worst
    assert worst <= set(named)
    who = "recall (" if regime == "heterogeneous" else "every agent about equally"
    assert f"RAM would dilute {who}" in verdict.sentence


def test_docs_quote_the_verdicts_as_computed():
    """docs/analyze.md quotes each regime's verdict: it is the sentence the
    stored report gives today."""
    page = Path(__file__).parent.parent / "docs/analyze.md"
    lines = page.read_text(encoding="utf-8").splitlines()
    quoted = " ".join(line[2:] for line in lines if line.startswith("> "))
    for block in regimes().values():
        assert probe_verdict(block["probe"]).sentence in quoted
