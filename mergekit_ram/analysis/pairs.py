"""The pairwise overlap of task models' change masks (report.json `pairwise`).

Observed from the counted statistics, next to what independent supports with
the same per-tensor densities would give (analysis.regime's expectations); the
report and the verdict (analysis.verdict) both read it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from mergekit_ram.analysis.regime import expected_intersections, jaccard, ratio
from mergekit_ram.core.counting import OverlapStatistics


def changed_per_tensor(
    stats: OverlapStatistics, ids: Sequence[Hashable]
) -> list[tuple[int, list[int]]]:
    """Per tensor: (elements, each task's changed count), the groups
    analysis.regime's expectations take."""
    groups = []
    for per_task in stats.per_tensor.values():
        if not per_task:
            continue
        elements = next(iter(per_task.values())).elements
        groups.append(
            (elements, [per_task[i].changed if i in per_task else 0 for i in ids])
        )
    return groups


def pairwise(stats: OverlapStatistics, ids: Sequence[Hashable]) -> dict[str, Any]:
    """N×N intersections |m_s ∧ m_t| and Jaccard overlaps, in `ids` order, and
    what independent supports with the same per-tensor densities would give."""
    n = len(ids)
    changed = [stats.tasks[i].changed for i in ids]
    inter = [
        [
            changed[s] if s == t else stats.tasks[a].intersections.get(b, 0)
            for t, b in enumerate(ids)
        ]
        for s, a in enumerate(ids)
    ]
    expected = expected_intersections(changed_per_tensor(stats, ids), n)

    def matrix(cell: Any) -> list[list[Any]]:
        return [[cell(s, t) for t in range(n)] for s in range(n)]

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
