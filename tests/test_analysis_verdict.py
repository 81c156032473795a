"""mergekit_ram.analysis.verdict: each threshold from both sides, the sentence,
the benchmark numbers it points to (docs/analyze.md, checked here), and the
agent it names on the two regimes of benchmarks/agents (their stored
`analyze` reports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mergekit_ram.analysis.verdict import (
    ALONE,
    KEPT_WHOLE,
    MEASURED,
    NESTED,
    OVERLAPPING,
    judge,
    pair_supports,
    unique_share_departure,
)

RESULTS = Path(__file__).parent.parent / "benchmarks/agents/results/results.json"
UP, DOWN = 1.001, 0.999  # just above / just below a threshold


OV, NE = OVERLAPPING, NESTED
PAIRS = [(1.0, NE * UP, "nested"), (1.0, NE * DOWN, "independent")]
PAIRS += [(OV * UP, 0.5, "overlapping"), (OV * DOWN, 0.5, "independent")]
PAIRS += [(1 / OV * DOWN, 0.1, "disjoint"), (1 / OV * UP, 0.1, "independent")]
PAIRS += [(None, 0.0, "disjoint"), (3.0, NE * UP, "nested")]  # nested over overlapping


@pytest.mark.parametrize(("lift", "inside", "kind"), PAIRS)
def test_pair_supports_on_both_sides_of_each_threshold(lift, inside, kind):
    assert pair_supports(lift, inside) == kind


SHARES = [(0.2, 0.2 * OVERLAPPING * UP, "below"), (0.2, 0.2 * OVERLAPPING * DOWN, None)]
SHARES += [
    (0.3 * OVERLAPPING * UP, 0.3, "above"),
    (0.3 * OVERLAPPING * DOWN, 0.3, None),
]
SHARES += [(0.193, 0.188, None), (None, 0.3, None)]  # the demo's coder: ≈ expected


@pytest.mark.parametrize(("observed", "expected", "departure"), SHARES)
def test_unique_share_departure_on_both_sides(observed, expected, departure):
    assert unique_share_departure(observed, expected) == departure


def verdict_on(models, labels, changed, intersection, lift, kept, **options):
    """judge on a report with these numbers; `kept`: each model's retention
    under RAM, None when the report has none (a merge's own pass)."""
    rows = zip(models, labels, changed, kept or [None] * len(models))
    tasks = [
        dict(model=m, label=x, changed=c, retention={"ram": k}) for m, x, c, k in rows
    ]
    pairwise = {"intersection": intersection, "lift": lift}
    report = dict(epsilon=options.pop("epsilon", 1e-5), tasks=tasks, pairwise=pairwise)
    report["retention"] = None if kept is None else {"methods": ["ram"]}
    return judge(report, **options)


def three(kept, lift=1.0, changed=(100, 100, 100), **options):
    """The verdict on three agents of 100 changes each whose pairs all have
    this lift (expected overlap 20), with RAM retentions `kept`; `changed`
    0 makes an agent change nothing (its pairs then overlap nowhere)."""

    def cell(s, t, value):
        return None if 0 in (changed[s], changed[t]) else value

    grid = [(s, t) for s in range(3) for t in range(3)]
    inter = [cell(s, t, 100 if s == t else 20 * lift) or 0 for s, t in grid]
    lifts = [cell(s, t, 1.0 if s == t else lift) for s, t in grid]
    inter, lifts = ([m[i : i + 3] for i in (0, 3, 6)] for m in (inter, lifts))
    labels = ["a", "b", "c"]
    models = [f"/m/{x}" for x in labels]
    return verdict_on(models, labels, list(changed), inter, lifts, kept, **options)


LOW, EVERY = 0.6, "every agent about equally (retention 0.68–0.72), a most"
WHOLE = f"RAM keeps at least {KEPT_WHOLE:g} of every agent"
ALONE_A = "RAM would dilute a (it keeps 0.60 of its task vector"
DILUTED = [([LOW, LOW / ALONE * UP, 0.8], "a", ALONE_A)]
DILUTED += [([LOW, LOW / ALONE * DOWN, 0.8], "ab", "dilute a and b about equally")]
DILUTED += [([LOW, LOW / ALONE * DOWN, 0.8], "ab", "), a most")]
DILUTED += [([0.68, 0.70, 0.72], "abc", EVERY)]
DILUTED += [([KEPT_WHOLE * UP, 0.95, 1.02], "", WHOLE)]
# Just below, the lowest is diluted (alone: the others keep ≥ 1/ALONE more).
DILUTED += [([KEPT_WHOLE * DOWN, 1.05, 1.1], "a", "RAM would dilute a")]
DILUTED += [(None, "", "mergekit-ram analyze")]  # no retention: where to get it


@pytest.mark.parametrize(("kept", "diluted", "said"), DILUTED)
def test_which_agents_are_diluted_alone_together_or_none(kept, diluted, said):
    verdict = three(kept)
    assert verdict["diluted"] == [f"/m/{x}" for x in diluted]
    assert said in verdict["sentence"]


def test_advice_follows_the_case():
    # The numbers are docs/analyze.md's; overlapping: `shared: ties` as a loss.
    for lift, supports in ((1.0, "independent"), (OVERLAPPING * UP, "overlapping")):
        verdict = three([0.6, 0.8, 0.8], lift=lift)
        said = verdict["sentence"]
        assert verdict["supports"] == supports and MEASURED in said
        assert "`shared: ties`" in said
        assert ("try `shared: ties`" in said) == (supports == "independent")
    equal = three([0.7, 0.7, 0.7])["sentence"]
    assert "compare with tuned task arithmetic" in equal and "shared: ties" not in equal


def test_mixed_supports_name_each_kind():
    # a ⊂ b (nested), a × c and b × c independent.
    intersection = [[10, 10, 2], [10, 50, 10], [2, 10, 20]]
    lift = [[1.0, 2.0, 1.0], [2.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    abc = ["a", "b", "c"]
    verdict = verdict_on(abc, abc, [10, 50, 20], intersection, lift, None)
    assert verdict["supports"] == "nested"
    kinds = [p["supports"] for p in verdict["pairs"]]
    assert kinds == ["nested", "independent", "independent"]
    assert verdict["sentence"].startswith(
        "supports mixed: nested for a × b (100 % of a's changes lie inside b's), "
        "independent for a × c and b × c (lift 1.00)"
    )


def test_one_task_model_and_one_that_changes_anything():
    one = verdict_on(["a"], ["a"], [5], [[5]], [[1.0]], [1.0])
    assert one["supports"] is None and one["pairs"] == [] and one["diluted"] == []
    assert one["sentence"].startswith("one task model")
    lift = [[1.0, None], [None, None]]
    idle = verdict_on(["a", "b"], ["a", "b"], [5, 0], [[5, 0], [0, 0]], lift, None)
    assert idle["supports"] is None and idle["diluted"] == []
    assert idle["sentence"].startswith(
        "only a changes anything above epsilon (1e-05); b changes nothing: there "
        "is nothing for RAM to average, so it adds a's task vector whole"
    )


def test_nothing_changed_means_the_base_model():
    """Epsilon above every change (--epsilon 100), or one task model that is a
    copy of the base: RAM returns the base model, no task vector is added."""
    every = three([0.0] * 3, changed=(0, 0, 0), epsilon=100.0)
    copy = verdict_on(["/m/copy"], ["copy"], [0], [[0]], [[None]], [None])
    for verdict in (every, copy):
        assert verdict["supports"] is None and verdict["diluted"] == []
        assert "whole" not in verdict["sentence"]
    assert every["sentence"] == (
        "no task model changes any element above epsilon (100), so there is "
        "nothing to merge and RAM returns the base model; if epsilon is larger "
        "than the fine-tuning's changes, lower `epsilon`, else check that the "
        "task models are not copies of the base."
    )
    assert copy["sentence"].startswith(
        "the task model changes no element above epsilon (1e-05), so there is "
        "nothing to merge and RAM returns the base model;"
    )
    assert "check that the task model is not a copy of the base" in copy["sentence"]


def test_agents_that_change_nothing_are_named_not_diluted():
    """An agent with no change above epsilon keeps 0 of its (sub-epsilon)
    task vector under RAM: the old verdict named it as the agent RAM dilutes
    ("RAM would dilute c (it keeps 0.00 ..."). It is named as changing
    nothing, and the others are judged without it."""
    verdict = three([0.6, 0.8, 0.0], changed=(100, 100, 0), epsilon=1e-5)
    assert verdict["diluted"] == ["/m/a"]
    assert [p["models"] for p in verdict["pairs"]] == [["/m/a", "/m/b"]]
    assert verdict["sentence"].startswith(
        "supports independent (lift 1.00: the agents change the same elements "
        "about as often as chance predicts); c changes nothing above epsilon "
        "(1e-05) and adds nothing to the merge; RAM would dilute a (it keeps 0.60 "
        "of its task vector, the other 0.80);"
    )
    assert "dilute c" not in verdict["sentence"]
    equal = three([0.7, 0.7, None], changed=(100, 100, 0))["sentence"]
    assert "RAM would dilute every other agent about equally" in equal
    whole = three([0.95, 1.0, 0.0], changed=(100, 100, 0))
    assert whole["diluted"] == []
    assert "RAM keeps at least 0.9 of every other agent's" in whole["sentence"]


def test_shared_ties_in_use_is_not_suggested():
    """Case (c): with `shared: ties` in the configuration (example_configs/
    ram_ties.yml) the old verdict still said "try `shared: ties`"; it says
    the configuration uses it, that the retention quoted is plain RAM's, and
    what remains to try."""
    kept = [0.6, 0.8, 0.8]
    ties = three(kept, shared="ties")
    assert "try `shared: ties`" not in ties["sentence"]
    assert ties["sentence"].endswith(
        "this configuration already uses `shared: ties`, which kept such an "
        "agent's task vector in mergekit-ram's agent benchmark and scored level "
        "with the best tuned baseline there, where RAM scored below it (numbers: "
        "mergekit-ram's docs/analyze.md#what-the-benchmark-measured; the "
        "retention above is RAM with `shared: mean`); beside it, compare with "
        "tuned task arithmetic / TIES / DARE."
    )
    overlapping = three(kept, lift=OVERLAPPING * UP, shared="ties")
    assert "`shared: ties`, which this configuration uses, " in overlapping["sentence"]
    # Another mode, or none known, keeps the suggestion.
    for shared in ("mean", "base", None):
        assert "try `shared: ties`" in three(kept, shared=shared)["sentence"]
    assert three(kept, shared="mean")["sentence"] == three(kept)["sentence"]


def regimes() -> dict:
    return json.loads(RESULTS.read_text(encoding="utf-8"))["regimes"]


REGIMES = [("heterogeneous", "independent"), ("homogeneous", "overlapping")]


@pytest.mark.parametrize(("regime", "supports"), REGIMES)
def test_verdict_names_the_agent_that_lost_accuracy(regime, supports):
    """On each regime's probe, the agent the verdict says RAM dilutes most is
    one whose task RAM lost most accuracy on against the best tuned
    baseline, and every such agent is named."""
    block = regimes()[regime]
    verdict = judge(block["probe"])
    assert verdict["supports"] == supports
    best, ram = block["rows"][block["reference"]], block["rows"]["ram"]
    loss = {task: best[task]["correct"] - ram[task]["correct"] for task in ram}
    worst = {task for task, lost in loss.items() if lost == max(loss.values())}
    label = {t["model"]: t["label"] for t in block["probe"]["tasks"]}
    named = [label[m] for m in verdict["diluted"]]
    assert named and named[0] in worst and worst <= set(named)
    who = "recall (" if regime == "heterogeneous" else "every agent about equally"
    assert f"RAM would dilute {who}" in verdict["sentence"]


# docs/analyze.md's table of what the verdict's advice rests on: (regime,
# results.json row) → the table's merge column.
TIES = "RAM, `shared: ties`"
MEASURED_ROWS = {(r, "ram"): "RAM" for r in ("heterogeneous", "homogeneous")}
MEASURED_ROWS |= {(r, "shared_ties"): TIES for r in ("heterogeneous", "homogeneous")}
MEASURED_ROWS |= {("homogeneous", "ramplus_fp32"): "RAM+ written in float32"}
BASELINES = {"task_arithmetic": "task arithmetic", "dare_ties": "DARE+TIES"}


def test_docs_quote_the_verdicts_and_the_numbers_as_computed():
    """docs/analyze.md quotes each regime's verdict as the stored report
    gives it today, and, in "What the benchmark measured" (where the
    verdict's advice points), results.json's numbers, rounded as cited."""
    docs = (Path(__file__).parent.parent / "docs/analyze.md").read_text("utf-8")
    lines = docs.splitlines()
    quoted = " ".join(line[2:] for line in lines if line.startswith("> "))
    found = regimes()
    for block in found.values():
        assert judge(block["probe"])["sentence"] in quoted
    assert MEASURED.endswith("docs/analyze.md#what-the-benchmark-measured")
    assert "## What the benchmark measured" in lines
    rows = {tuple(c.strip() for c in line.split("|")[1:-1]) for line in lines}
    for (regime, row), merge in MEASURED_ROWS.items():
        paired = found[regime]["paired"][row]
        low, high = (round(100 * v, 1) for v in paired["ci95"])
        cited = f"{round(100 * paired['difference'], 1):+.1f} [{low:+.1f}, {high:+.1f}]"
        baseline = BASELINES[found[regime]["reference"]]
        table = [r for r in rows if len(r) == 4 and r[0].startswith(regime)]
        assert (merge, baseline, cited) in [r[1:] for r in table], (regime, row)
    kept = found["heterogeneous"]["support"]["retention"]
    assert (
        f"RAM {kept['ram']['recall']:.2f}, RAM with `shared: ties` "
        f"{kept['shared_ties']['recall']:.2f}."
    ) in " ".join(docs.split())
