"""Which regime a merge is in (docs/report_schema.md, `regime`).

Two numbers tell whether RAM should beat averaging. Do the agents' change
masks overlap more than independent supports with the same per-tensor
densities would (lift ≈ 1: independent-like, the paper's regime; lift ≫ 1:
heavily overlapping)? And how much of agent t's task vector does a merged task
vector keep, retention = ⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩? The expectations follow
from the per-tensor counts alone. Retention needs inner products of task
vectors: the counting pass sums, per tensor, the few that determine retention
under RAM, RAM+ (any λ, known only once the whole model is counted) and task
arithmetic (`core.counting.Products`), and `retentions` combines them at the end.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence

from mergekit_ram.core.counting import Products

# Methods whose retention is reported, in report order → their name in tables
# and figures (task arithmetic with weight 1/N and 1).
METHODS = {"ram": "RAM", "ramplus": "RAM+", "ta_mean": "TA 1/N", "ta_sum": "TA 1"}


def expected_intersections(
    groups: Iterable[tuple[int, Sequence[int]]], tasks: int
) -> list[list[float]]:
    """E[s][t] = Σ_k C_s,k · C_t,k / n_k (the diagonal: C_t).

    `groups`: per tensor k its element count n_k and each task's changed count
    C_t,k. E is the expected |m_s ∧ m_t| if every task changed a uniformly
    random subset of each tensor with its observed density d = C / n,
    independently of the others: Σ_k n_k · d_s,k · d_t,k.
    """
    expected = [[0.0] * tasks for _ in range(tasks)]
    for elements, changed in groups:
        if not elements:
            continue
        for s in range(tasks):
            for t in range(tasks):
                if s == t:
                    expected[s][t] += changed[s]
                else:
                    expected[s][t] += changed[s] * changed[t] / elements
    return expected


def expected_unique(
    groups: Iterable[tuple[int, Sequence[int]]], tasks: int
) -> list[float]:
    """Σ_k C_t,k · Π_{s≠t} (1 − d_s,k): task t's unique elements expected
    under the same independence as `expected_intersections`."""
    expected = [0.0] * tasks
    for elements, changed in groups:
        if not elements:
            continue
        for t in range(tasks):
            alone = float(changed[t])
            for s in range(tasks):
                if s != t:
                    alone *= 1.0 - changed[s] / elements
            expected[t] += alone
    return expected


def ratio(observed: float, expected: float) -> float | None:
    """observed / expected; None when expected is 0.

    For an overlap (lift) expected 0 means that in every tensor one of the
    two tasks changes nothing, so the observed overlap is 0 too: 0 / 0.
    """
    return observed / expected if expected else None


def jaccard(intersection: float, changed_s: float, changed_t: float) -> float:
    """I / (C_s + C_t − I); 0 when both masks are empty."""
    union = changed_s + changed_t - intersection
    return intersection / union if union else 0.0


def retentions(
    groups: Iterable[tuple[Products, Mapping[Hashable, float]]],
    ids: Sequence[Hashable],
) -> dict[str, dict[Hashable, float | None]]:
    """Per method of METHODS and task: ⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩.

    `groups`: each tensor's Products with the RAM+ λ of every task in it
    (global λ: the same mapping for every tensor). `ram` uses λ = 1,
    `ramplus` those λ, `ta_mean` task arithmetic with weight 1/N, `ta_sum`
    with weight 1 (N = len(ids)). None where ⟨τ_t, τ_t⟩ = 0 (the task
    changes nothing: retention is undefined).
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
    return {
        method: {
            task: (
                values[task] / norms[task]
                if norms[task] > 0 and math.isfinite(norms[task])
                else None
            )
            for task in ids
        }
        for method, values in numerators.items()
    }
