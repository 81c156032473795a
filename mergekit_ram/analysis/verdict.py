"""Which case a merge's task models are in, said in one sentence: the verdict.

`mergekit-ram analyze` (its text, report.json's `verdict`, report.md) and the
model card of a merge that counted whole-model statistics state it, so that a
user reads the case off the numbers instead of interpreting tables. It says
three things, each decided by a threshold below (docs/analyze.md, "The
verdict", says which measurements each was chosen from):

- the supports, per pair of task models: nested (at least NESTED of the
  smaller change mask lies inside the larger), overlapping (lift at least
  OVERLAPPING), disjoint (lift at most 1 / OVERLAPPING) or independent;
- which agent RAM would dilute: the one with the lowest retention under RAM,
  with every agent within a factor ALONE of it, unless every agent keeps at
  least KEPT_WHOLE of its task vector;
- what to try beside RAM: what benchmarks/agents measured in that case, as
  something to try, pointing to the numbers (docs/analyze.md, "What the
  benchmark measured"); never what the configuration already uses (`shared`).

Task models that change no element above epsilon are named as such: they add
nothing to the merge, so RAM neither dilutes nor keeps them, and when none
changes anything the merge is the base model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mergekit_ram.analysis.naming import labels_for
from mergekit_ram.analysis.pairs import pairwise
from mergekit_ram.analysis.regime import ratio, retentions
from mergekit_ram.core.counting import OverlapStatistics

# A pair overlaps when its lift (observed overlap / the overlap of independent
# supports) is at least this, and avoids each other at most its inverse; a
# unique share this far below or above its expectation is noted likewise.
OVERLAPPING = 1.5
# A pair is nested when this share of the smaller change mask lies inside the
# larger one (its agent then has at most 1 − NESTED of its changes to itself).
NESTED = 0.9
# An agent whose retention under RAM is at least this is kept (nearly) whole.
KEPT_WHOLE = 0.9
# Agents whose retention is within this factor of the lowest are diluted alike;
# below it the lowest one is diluted alone.
ALONE = 0.9

# Pair kinds, in the order the whole merge is named after them.
KINDS = ("nested", "overlapping", "disjoint", "independent")


TUNED = "tuned task arithmetic / TIES / DARE"
BENCHMARK = "mergekit-ram's agent benchmark"
# Where its numbers are (documentation, not code: a test checks them against
# benchmarks/agents/results/results.json).
MEASURED = "numbers: mergekit-ram's docs/analyze.md#what-the-benchmark-measured"


@dataclass(frozen=True)
class PairSupports:
    """How one pair's change masks relate; `inside`: the share of the smaller
    mask that lies inside the larger (|m_s ∧ m_t| / min(C_s, C_t))."""

    models: tuple[str, str]
    supports: str
    lift: float | None
    inside: float


@dataclass(frozen=True)
class Verdict:
    """The verdict's findings and its sentence (report.json `verdict`)."""

    supports: str | None
    pairs: tuple[PairSupports, ...]
    diluted: tuple[str, ...]
    sentence: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "sentence": self.sentence,
            "supports": self.supports,
            "diluted": list(self.diluted),
            "pairs": [
                {"models": list(p.models), "supports": p.supports, "inside": p.inside}
                for p in self.pairs
            ],
        }


def pair_supports(lift: float | None, inside: float) -> str:
    """nested, overlapping, disjoint or independent (thresholds above).

    lift None: independent supports would not overlap at all (in every
    tensor one of the two changes nothing), so neither do these.
    """
    if inside >= NESTED:
        return "nested"
    if lift is None or lift * OVERLAPPING <= 1.0:
        return "disjoint"
    if lift >= OVERLAPPING:
        return "overlapping"
    return "independent"


def unique_share_departure(
    observed: float | None, expected: float | None
) -> str | None:
    """Whether a unique share is a factor OVERLAPPING below or above its
    expectation for independent supports: "below", "above" or None."""
    if observed is None or expected is None:
        return None
    if observed * OVERLAPPING <= expected:
        return "below"
    if observed >= expected * OVERLAPPING:
        return "above"
    return None


ONE_MODEL = (
    "one task model: every change it makes is its own, so RAM adds its whole "
    "task vector, as task arithmetic with weight 1 does."
)


def judge(
    models: Sequence[str],
    labels: Sequence[str],
    changed: Sequence[int],
    intersection: Sequence[Sequence[float]],
    expected: Sequence[Sequence[float]],
    kept: Sequence[float | None] | None,
    *,
    epsilon: float | None = None,
    shared: str | None = None,
) -> Verdict:
    """The verdict on task models with these counts.

    `intersection` / `expected`: the observed and independent overlaps of
    each pair (report.json `pairwise`); `kept`: each model's retention under
    RAM, None where it was not computed (a merge without inner products);
    `epsilon`: the change threshold, quoted when some model changes nothing;
    `shared`: the configuration's `shared` mode, None when unknown or it
    varies per tensor, so the advice never suggests what is already in use.
    """
    label = dict(zip(models, labels))
    active = [m for m, c in zip(models, changed) if c > 0]
    idle = [label[m] for m, c in zip(models, changed) if c == 0]
    if not active:
        return Verdict(None, (), (), _nothing_changed(len(models), epsilon))
    if len(models) < 2:
        return Verdict(None, (), (), ONE_MODEL)
    if len(active) == 1:
        return Verdict(None, (), (), _only_one(label[active[0]], idle, epsilon))
    size = dict(zip(models, changed))
    pairs = _pairs(models, changed, intersection, expected)
    supports = next(kind for kind in KINDS if any(p.supports == kind for p in pairs))
    live = None if kept is None else [k for k, c in zip(kept, changed) if c > 0]
    diluted, dilution = _dilution(active, label, live, idle=bool(idle))
    clauses = [
        _supports_clause(pairs, label, size),
        *([_idle_clause(idle, epsilon)] if idle else []),
        dilution,
        _advice(supports, len(diluted) == 1, shared),
    ]
    return Verdict(supports, tuple(pairs), diluted, "; ".join(clauses) + ".")


def _pairs(
    models: Sequence[str],
    changed: Sequence[int],
    intersection: Sequence[Sequence[float]],
    expected: Sequence[Sequence[float]],
) -> list[PairSupports]:
    """How each pair of models that both change something relates."""
    pairs = []
    for s in range(len(models)):
        for t in range(s + 1, len(models)):
            smaller = min(changed[s], changed[t])
            if smaller == 0:
                continue  # a model that changes nothing overlaps no one
            inside = intersection[s][t] / smaller
            lift = ratio(intersection[s][t], expected[s][t])
            kind = pair_supports(lift, inside)
            pairs.append(PairSupports((models[s], models[t]), kind, lift, inside))
    return pairs


def _above(epsilon: float | None) -> str:
    """'above epsilon (1e-05)': the threshold a change must exceed to count."""
    return "above epsilon" if epsilon is None else f"above epsilon ({epsilon:g})"


def _nothing_changed(count: int, epsilon: float | None) -> str:
    """No task vector has an element above epsilon: RAM returns the base, and
    the likely causes are an epsilon above the fine-tuning's changes or task
    models that are copies of the base."""
    who = "the task model changes no" if count == 1 else "no task model changes any"
    models = "model is not a copy" if count == 1 else "models are not copies"
    return (
        f"{who} element {_above(epsilon)}, so there is nothing to merge and "
        "RAM returns the base model; if epsilon is larger than the fine-tuning's "
        f"changes, lower `epsilon`, else check that the task {models} of the base."
    )


def _only_one(name: str, idle: Sequence[str], epsilon: float | None) -> str:
    """One model changes something and the others nothing: RAM adds that task
    vector whole, and the others are named so they are not taken for
    agents RAM keeps."""
    nothing = "changes nothing" if len(idle) == 1 else "change nothing"
    return (
        f"only {name} changes anything {_above(epsilon)}; {_names(idle)} "
        f"{nothing}: there is nothing for RAM to average, so it adds {name}'s "
        "task vector whole, as task arithmetic with weight 1 does."
    )


def _idle_clause(idle: Sequence[str], epsilon: float | None) -> str:
    """The models that change nothing: they add nothing, so RAM neither
    dilutes nor keeps them (their retention is 0 or undefined)."""
    verb = "changes nothing" if len(idle) == 1 else "change nothing"
    adds = "adds" if len(idle) == 1 else "add"
    return f"{_names(idle)} {verb} {_above(epsilon)} and {adds} nothing to the merge"


def verdict_of(stats: OverlapStatistics, shared: str | None = None) -> Verdict:
    """The verdict on counted statistics; without inner products (a merge's
    own pass) it cannot say which agent RAM dilutes. `shared`: the
    configuration's `shared` mode (judge), None when unknown."""
    ids = list(stats.tasks)
    models = [str(i) for i in ids]
    labels = labels_for(models)
    pair = pairwise(stats, ids)
    kept = None
    if stats.inner_products:
        ram = retentions(((p, {}) for p in stats.products.values()), ids)["ram"]
        kept = [ram[i] for i in ids]
    return judge(
        models,
        [labels[m] for m in models],
        [stats.tasks[i].changed for i in ids],
        pair["intersection"],
        pair["expected_intersection"],
        kept,
        epsilon=stats.epsilon,
        shared=shared,
    )


def _span(values: Sequence[float], digits: int = 2) -> str:
    """'0.68–0.72', or one number when they print the same."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}–{high}"


def _names(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


GLOSS = {
    "independent": "the agents change the same elements about as often as "
    "chance predicts",
    "overlapping": "the agents change the same elements far more often than "
    "chance predicts",
    "disjoint": "the agents avoid each other's elements",
}


def _evidence(
    kind: str, pairs: Sequence[PairSupports], label: Mapping, size: Mapping
) -> str:
    """The numbers behind one kind of pair: containment or lift."""
    if kind == "nested":
        return ", ".join(_inside(p, label, size) for p in pairs)
    lifts = [p.lift for p in pairs if p.lift is not None]
    return f"lift {_span(lifts)}" if lifts else "in different tensors"


def _inside(pair: PairSupports, label: Mapping, size: Mapping) -> str:
    small, large = sorted(pair.models, key=size.__getitem__)
    return (
        f"{100 * pair.inside:.0f} % of {label[small]}'s changes lie inside "
        f"{label[large]}'s"
    )


def _supports_clause(
    pairs: Sequence[PairSupports], label: Mapping, size: Mapping
) -> str:
    kinds = [kind for kind in KINDS if any(p.supports == kind for p in pairs)]
    if len(kinds) == 1:
        kind = kinds[0]
        evidence = _evidence(kind, pairs, label, size)
        if kind != "nested":
            every = " for every pair" if len(pairs) > 1 else ""
            evidence += f"{every}: {GLOSS[kind]}"
        return f"supports {kind} ({evidence})"
    parts = []
    for kind in kinds:
        group = [p for p in pairs if p.supports == kind]
        names = _names([" × ".join(label[m] for m in p.models) for p in group])
        parts.append(f"{kind} for {names} ({_evidence(kind, group, label, size)})")
    return "supports mixed: " + ", ".join(parts)


def _dilution(
    models: Sequence[str],
    label: Mapping,
    kept: Sequence[float | None] | None,
    idle: bool = False,
) -> tuple[tuple[str, ...], str]:
    """(the models RAM dilutes most, lowest retention first; the clause).

    `models`: those that change something; `idle`: whether some model
    changing nothing was left out, so "every agent" says "every other agent".
    """
    every = "every other agent" if idle else "every agent"
    if kept is None:
        return (), (
            "to see which agent RAM would dilute, run mergekit-ram analyze on "
            "this configuration"
        )
    known = {m: k for m, k in zip(models, kept) if k is not None}
    if not known:
        return (), "no agent changes anything RAM could dilute"
    lowest = min(known.values())
    if lowest >= KEPT_WHOLE:
        return (), (
            f"RAM keeps at least {KEPT_WHOLE:g} of {every}'s task vector "
            f"(retention {_span(list(known.values()))})"
        )
    limit = lowest / ALONE if lowest > 0 else lowest
    diluted = sorted(
        (m for m, k in known.items() if k <= limit and k < KEPT_WHOLE),
        key=known.__getitem__,
    )
    others = [k for m, k in known.items() if m not in diluted]
    rest = ""
    if others:
        rest = f", the {'other' if len(others) == 1 else 'others'} {_span(others)}"
    if len(diluted) == 1:
        clause = (
            f"RAM would dilute {label[diluted[0]]} (it keeps {lowest:.2f} of its "
            f"task vector{rest})"
        )
    else:
        who = every if not others else _names([label[m] for m in diluted])
        share = _span([known[m] for m in diluted])
        clause = (
            f"RAM would dilute {who} about equally (retention {share}{rest}), "
            f"{label[diluted[0]]} most"
        )
    return tuple(diluted), clause


def _advice(supports: str, alone: bool, shared: str | None = None) -> str:
    """What to try beside RAM, from what benchmarks/agents measured; never
    the `shared` mode the configuration already uses (`shared`)."""
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
    if alone and ties:
        return (
            "this configuration already uses `shared: ties`, "
            f"{_ties_kept('; the retention above is RAM with `shared: mean`')}; "
            f"beside it, compare with {TUNED}"
        )
    if alone:
        return f"beside RAM, try `shared: ties`, {_ties_kept('')}, and {TUNED}"
    return (
        f"compare with {TUNED}: in neither regime of {BENCHMARK} did RAM beat "
        f"the best tuned one ({MEASURED})"
    )


def _ties_kept(note: str) -> str:
    """What `shared: ties` did for the benchmark's sparse agent: the evidence
    for trying it, or for keeping it where it is in use (`note` inside the
    parenthesis)."""
    return (
        f"which kept such an agent's task vector in {BENCHMARK} and scored "
        f"level with the best tuned baseline there, where RAM scored below it "
        f"({MEASURED}{note})"
    )
