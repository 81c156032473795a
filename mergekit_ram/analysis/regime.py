"""Which regime a merge is in (docs/report_schema.md, `pairwise`, `retention`).

Two numbers tell whether RAM should beat averaging. Do the agents' change
masks overlap more than independent supports with the same per-tensor
densities would (lift ≈ 1: independent-like, the paper's regime; lift ≫ 1:
heavily overlapping)? And how much of agent t's task vector does a merged task
vector keep, retention = ⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩? The expectations follow
from the per-tensor counts alone; retention combines the few inner products
the counting pass sums per tensor (`core.counting.Products`), because RAM+'s λ is known
only once the whole model is counted.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from mergekit_ram.core.counting import OverlapStatistics, Products

# Methods whose retention is reported, in report order → their name in tables
# and figures (task arithmetic with weight 1/N and 1).
METHODS = {"ram": "RAM", "ramplus": "RAM+", "ta_mean": "TA 1/N", "ta_sum": "TA 1"}

Groups = Iterable[tuple[int, Sequence[int]]]


def changed_per_tensor(
    stats: OverlapStatistics, ids: Sequence[Hashable]
) -> list[tuple[int, list[int]]]:
    """Per tensor: (elements n_k, each task's changed count C_t,k)."""
    groups = []
    for per_task in stats.per_tensor.values():
        # An empty tensor changes nothing and expects nothing.
        if elements := (next(iter(per_task.values())).elements if per_task else 0):
            changed = [per_task[i].changed if i in per_task else 0 for i in ids]
            groups.append((elements, changed))
    return groups


def expected(groups: Groups, tasks: int) -> tuple[list[list[float]], list[float]]:
    """What independent supports would give, if every task changed a
    uniformly random subset of each tensor with its observed density:
    E[s][t] = Σ_k C_s,k · C_t,k / n_k, the expected |m_s ∧ m_t| (the
    diagonal: C_t), and Σ_k C_t,k · Π_{s≠t} (1 − C_s,k / n_k), task t's
    expected unique elements."""
    inter = [[0.0] * tasks for _ in range(tasks)]
    unique = [0.0] * tasks
    for elements, changed in groups:
        for s in range(tasks):
            alone = float(changed[s])
            for t in range(tasks):
                if s == t:
                    inter[s][t] += changed[s]
                else:
                    inter[s][t] += changed[s] * changed[t] / elements
                    alone *= 1.0 - changed[t] / elements
            unique[s] += alone
    return inter, unique


def ratio(observed: float, expected: float) -> float | None:
    """observed / expected; None when expected is 0 (for a lift: in every
    tensor one of the two tasks changes nothing, so the overlap is 0 / 0)."""
    return observed / expected if expected else None


def jaccard(intersection: float, changed_s: float, changed_t: float) -> float:
    """I / (C_s + C_t − I); 0 when both masks are empty."""
    union = changed_s + changed_t - intersection
    return intersection / union if union else 0.0


def pairwise(
    stats: OverlapStatistics, ids: Sequence[Hashable], expected: list[list[float]]
) -> dict[str, Any]:
    """report.json `pairwise`: N×N intersections |m_s ∧ m_t| and Jaccard
    overlaps in `ids` order, beside what independent supports would give
    (`expected`, the intersections of `expected`)."""
    n, found = len(ids), [stats.tasks[i] for i in ids]
    changed = [counts.changed for counts in found]

    def matrix(cell: Any) -> list[list[Any]]:
        return [[cell(s, t) for t in range(n)] for s in range(n)]

    inter = matrix(
        lambda s, t: changed[s] if s == t else found[s].intersections.get(ids[t], 0)
    )

    return {
        "models": [str(i) for i in ids],
        "intersection": inter,
        "jaccard": matrix(lambda s, t: jaccard(inter[s][t], changed[s], changed[t])),
        "expected_intersection": expected,
        "lift": matrix(lambda s, t: ratio(inter[s][t], expected[s][t])),
        "expected_jaccard": matrix(
            lambda s, t: jaccard(expected[s][t], changed[s], changed[t])
        ),
    }


def retentions(
    groups: Iterable[tuple[Products, Mapping[Hashable, float]]],
    ids: Sequence[Hashable],
) -> dict[str, dict[Hashable, float | None]]:
    """Per method of METHODS and task: ⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩.

    `groups`: each tensor's Products with the RAM+ λ of every task in it.
    `ram` uses λ = 1, `ramplus` those λ, `ta_mean` / `ta_sum` task arithmetic
    with weight 1/N / 1. None where ⟨τ_t, τ_t⟩ = 0 (the task changes nothing).
    """
    numerators = {m: dict.fromkeys(ids, 0.0) for m in METHODS}
    norms = dict.fromkeys(ids, 0.0)
    for products, scales in groups:
        members = products.ids
        for j, task in enumerate(members):
            column = sum(products.gram[s][j] for s in range(len(members)))
            norms[task] += products.gram[j][j]
            numerators["ram"][task] += products.ram[j]
            numerators["ramplus"][task] += products.ram[j] + sum(
                (scales.get(other, 1.0) - 1.0) * products.owned[s][j]
                for s, other in enumerate(members)
            )
            numerators["ta_mean"][task] += column / len(ids)
            numerators["ta_sum"][task] += column
    kept = {task for task in ids if norms[task] > 0 and math.isfinite(norms[task])}
    return {
        method: {t: values[t] / norms[t] if t in kept else None for t in ids}
        for method, values in numerators.items()
    }
