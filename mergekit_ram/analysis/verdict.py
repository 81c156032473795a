"""Which case a merge's task models are in, said in one sentence: the verdict.

`mergekit-ram analyze` and the model card of a merge that counted whole-model
statistics state it, so that a user reads the case off the numbers instead of
interpreting tables. It says three things, each decided by a threshold below
(docs/analyze.md, "The verdict", says which measurements each was chosen from):

- the supports, per pair of task models: nested (at least NESTED of the
  smaller change mask lies inside the larger), overlapping (lift at least
  OVERLAPPING), disjoint (lift at most 1 / OVERLAPPING) or independent;
- which agent RAM would dilute: the one with the lowest retention under RAM,
  with every agent within a factor ALONE of it, unless every agent keeps at
  least KEPT_WHOLE of its task vector;
- what to try beside RAM: what benchmarks/agents measured in that case,
  pointing to the numbers; never what the configuration already uses.

Task models that change no element above epsilon add nothing to the merge:
they are named as such, never as diluted, and when none changes anything the
merge is the base model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A pair overlaps when its lift (observed overlap / the overlap of independent
# supports) is at least this, and avoids each other at most its inverse; a
# unique share this far below or above its expectation is noted likewise.
OVERLAPPING = 1.5
# A pair is nested when this share of the smaller change mask lies inside the larger.
NESTED = 0.9
# An agent whose retention under RAM is at least this is kept (nearly) whole.
KEPT_WHOLE = 0.9
# Agents whose retention is within this factor of the lowest are diluted alike.
ALONE = 0.9
# Pair kinds, in the order the whole merge is named after them.
KINDS = ("nested", "overlapping", "disjoint", "independent")

TUNED = "tuned task arithmetic / TIES / DARE"
BENCHMARK = "mergekit-ram's agent benchmark"
# Where its numbers are: documentation, not code (a test checks them).
MEASURED = "numbers: mergekit-ram's docs/analyze.md#what-the-benchmark-measured"
ONE_MODEL = (
    "one task model: every change it makes is its own, so RAM adds its whole "
    "task vector, as task arithmetic with weight 1 does."
)
GLOSS = {
    "independent": "the agents change the same elements about as often as "
    "chance predicts",
    "overlapping": "the agents change the same elements far more often than "
    "chance predicts",
    "disjoint": "the agents avoid each other's elements",
}


Pair = dict[str, Any]  # models, supports, inside (report.json) and lift


def _verdict(
    sentence: str,
    supports: str | None = None,
    pairs: Sequence[Pair] = (),
    diluted: Sequence[str] = (),
) -> dict[str, Any]:
    """report.json `verdict`: the sentence and the findings it states; a
    pair's `inside` is the share of the smaller change mask that lies inside
    the larger (|m_s ∧ m_t| / min(C_s, C_t))."""
    pairs = [{k: p[k] for k in ("models", "supports", "inside")} for p in pairs]
    found = dict(sentence=sentence, supports=supports)
    return found | dict(diluted=list(diluted), pairs=pairs)


def pair_supports(lift: float | None, inside: float) -> str:
    """nested, overlapping, disjoint or independent (thresholds above); lift
    None: independent supports would not overlap at all, nor do these."""
    if inside >= NESTED:
        return "nested"
    if lift is None or lift * OVERLAPPING <= 1.0:
        return "disjoint"
    return "overlapping" if lift >= OVERLAPPING else "independent"


def unique_share_departure(
    observed: float | None, expected: float | None
) -> str | None:
    """Whether a unique share is a factor OVERLAPPING below or above its
    expectation for independent supports: "below", "above" or None."""
    if observed is None or expected is None:
        return None
    if observed * OVERLAPPING <= expected:
        return "below"
    return "above" if observed >= expected * OVERLAPPING else None


def judge(report: Mapping[str, Any], shared: str | None = None) -> dict[str, Any]:
    """The verdict on a report's numbers (report.json without `verdict`):
    each task's changes, each pair's overlap and lift, each task's retention
    under RAM where computed (not after a merge's own pass); `shared`: the
    configuration's `shared` mode (None: unknown or varying per tensor)."""
    tasks, pair = report["tasks"], report["pairwise"]
    models = [t["model"] for t in tasks]
    label = {t["model"]: t["label"] for t in tasks}
    size = {t["model"]: t["changed"] for t in tasks}
    active = [m for m in models if size[m] > 0]
    idle = [label[m] for m in models if size[m] == 0]
    above = f"above epsilon ({report['epsilon']:g})"
    ends = "s" * (len(idle) == 1)  # "b changes", "b and c change"
    one = len(models) == 1
    if not active:
        who = "the task model changes no" if one else "no task model changes any"
        copies = "model is not a copy" if one else "models are not copies"
        return _verdict(
            f"{who} element {above}, so there is nothing to merge and RAM returns "
            "the base model; if epsilon is larger than the fine-tuning's changes, "
            f"lower `epsilon`, else check that the task {copies} of the base."
        )
    if one:
        return _verdict(ONE_MODEL)
    if len(active) == 1:
        name = label[active[0]]
        return _verdict(
            f"only {name} changes anything {above}; {_names(idle)} change{ends} "
            f"nothing: there is nothing for RAM to average, so it adds {name}'s task "
            "vector whole, as task arithmetic with weight 1 does."
        )
    pairs = []
    for s, a in enumerate(models):
        for t, b in enumerate(models[s + 1 :], s + 1):
            # A model that changes nothing overlaps no one.
            if smaller := min(size[a], size[b]):
                inside, lift = pair["intersection"][s][t] / smaller, pair["lift"][s][t]
                kind = pair_supports(lift, inside)
                pairs += [dict(models=[a, b], supports=kind, inside=inside, lift=lift)]
    supports = next(kind for kind in KINDS if any(p["supports"] == kind for p in pairs))
    kept = None
    if report["retention"] is not None:
        kept = {t["model"]: t["retention"]["ram"] for t in tasks if t["changed"]}
    every = "every other agent" if idle else "every agent"
    diluted, dilution = _dilution(kept, label, every)
    clauses = [_supports_clause(pairs, label, size)]
    if idle:
        idling = f"{_names(idle)} change{ends} nothing {above}"
        clauses.append(f"{idling} and add{ends} nothing to the merge")
    clauses += [dilution, _advice(supports, len(diluted) == 1, shared)]
    return _verdict("; ".join(clauses) + ".", supports, pairs, diluted)


def _span(values: Sequence[float], digits: int = 2) -> str:
    """'0.68–0.72', or one number when they print the same."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}–{high}"


def _names(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _evidence(kind: str, pairs: Sequence[Pair], label: Mapping, size: Mapping) -> str:
    """The numbers behind one kind of pair: containment or lift."""
    if kind == "nested":
        inside = []
        for p in pairs:
            small, large = sorted(p["models"], key=size.__getitem__)
            share = f"{100 * p['inside']:.0f} % of {label[small]}'s changes"
            inside.append(f"{share} lie inside {label[large]}'s")
        return ", ".join(inside)
    lifts = [p["lift"] for p in pairs if p["lift"] is not None]
    return f"lift {_span(lifts)}" if lifts else "in different tensors"


def _supports_clause(pairs: Sequence[Pair], label: Mapping, size: Mapping) -> str:
    kinds = [kind for kind in KINDS if any(p["supports"] == kind for p in pairs)]
    if len(kinds) == 1:
        kind = kinds[0]
        evidence = _evidence(kind, pairs, label, size)
        if kind != "nested":
            every = " for every pair" if len(pairs) > 1 else ""
            evidence += f"{every}: {GLOSS[kind]}"
        return f"supports {kind} ({evidence})"
    parts = []
    for kind in kinds:
        group = [p for p in pairs if p["supports"] == kind]
        names = _names([" × ".join(label[m] for m in p["models"]) for p in group])
        parts.append(f"{kind} for {names} ({_evidence(kind, group, label, size)})")
    return "supports mixed: " + ", ".join(parts)


def _dilution(
    kept: Mapping[str, float | None] | None, label: Mapping, every: str
) -> tuple[tuple[str, ...], str]:
    """(the models RAM dilutes most, lowest retention first; the clause), from
    the RAM retention of each model that changes something."""
    if kept is None:
        return (), (
            "to see which agent RAM would dilute, run mergekit-ram analyze on "
            "this configuration"
        )
    if not (known := {m: k for m, k in kept.items() if k is not None}):
        return (), "no agent changes anything RAM could dilute"
    lowest = min(known.values())
    if lowest >= KEPT_WHOLE:
        return (), (
            f"RAM keeps at least {KEPT_WHOLE:g} of {every}'s task vector "
            f"(retention {_span(list(known.values()))})"
        )
    limit = lowest / ALONE if lowest > 0 else lowest
    diluted = [m for m, k in known.items() if k <= limit and k < KEPT_WHOLE]
    diluted.sort(key=known.__getitem__)
    others = [k for m, k in known.items() if m not in diluted]
    rest = f", the other{'s' * (len(others) > 1)} {_span(others)}" if others else ""
    if len(diluted) == 1:
        return tuple(diluted), (
            f"RAM would dilute {label[diluted[0]]} (it keeps {lowest:.2f} of its "
            f"task vector{rest})"
        )
    who = _names([label[m] for m in diluted]) if others else every
    return tuple(diluted), (
        f"RAM would dilute {who} about equally (retention "
        f"{_span([known[m] for m in diluted])}{rest}), {label[diluted[0]]} most"
    )


def _advice(supports: str, alone: bool, shared: str | None) -> str:
    """What to try beside RAM, from what benchmarks/agents measured; never
    the `shared` mode the configuration already uses."""
    ties = shared == "ties"
    if supports == "nested":
        return (
            f"beside RAM, try {TUNED}: RAM averages every change of the nested "
            f"agent with the agent it lies inside, and {BENCHMARK} has no "
            "nested agents"
        )
    if supports == "overlapping":
        used = ", which this configuration uses," if ties else ""
        return (
            f"beside RAM, try {TUNED}: in {BENCHMARK} with overlapping supports "
            f"RAM, RAM+ written in float32 and `shared: ties`{used} all scored "
            f"below the best tuned baseline ({MEASURED})"
        )
    if not alone:
        return (
            f"compare with {TUNED}: in neither regime of {BENCHMARK} did RAM beat "
            f"the best tuned one ({MEASURED})"
        )
    # What `shared: ties` did for the benchmark's sparse agent: the evidence
    # for trying it, or for keeping it where it is in use.
    note = "; the retention above is RAM with `shared: mean`" if ties else ""
    kept = (
        f"which kept such an agent's task vector in {BENCHMARK} and scored "
        f"level with the best tuned baseline there, where RAM scored below it "
        f"({MEASURED}{note})"
    )
    if ties:
        used = "this configuration already uses `shared: ties`"
        return f"{used}, {kept}; beside it, compare with {TUNED}"
    return f"beside RAM, try `shared: ties`, {kept}, and {TUNED}"
