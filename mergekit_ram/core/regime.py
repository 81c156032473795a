"""Which regime a merge is in (docs/report_schema.md, `regime`).

Two numbers tell whether RAM should beat averaging. Do the agents' change
masks overlap more than independent supports with the same per-tensor
densities would (lift ≈ 1: independent-like, the paper's regime; lift ≫ 1:
heavily overlapping)? And how much of agent t's task vector does a merged task
vector keep, retention = ⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩? The expectations follow
from the per-tensor counts alone. Retention needs inner products of task
vectors: `inner_products` sums, per tensor, the few that determine retention
under RAM, RAM+ (any λ, known only once the whole model is counted) and task
arithmetic, and `retentions` combines them at the end.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

# Methods whose retention is reported, in report order.
METHODS = ("ram", "ramplus", "ta_mean", "ta_sum")


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


@dataclass
class Products:
    """Inner products of one tensor's task vectors, summed in float64.

    With τ_s the task vectors, m_s their change masks and c the overlap count
    (docs/spec.md): gram[s][t] = ⟨τ_s, τ_t⟩; owned[s][t] = ⟨τ_s·[c = 1]·m_s,
    τ_t⟩ (s's unique elements); ram[t] = ⟨τ_RAM, τ_t⟩ with τ_RAM the RAM merge
    at λ = 1 (Σ_active τ / c). RAM+ scales only s's unique elements by λ_s,
    so its product is ram[t] + Σ_s (λ_s − 1)·owned[s][t]; task arithmetic's
    is Σ_s w·gram[s][t]. Full τ, sub-threshold values included, so the
    numbers are exact inner products of the float32 vectors.
    """

    ids: list[Hashable]
    gram: list[list[float]]
    owned: list[list[float]]
    ram: list[float]

    @classmethod
    def zeros(cls, ids: Sequence[Hashable]) -> Products:
        n = len(ids)
        return cls(
            list(ids), [[0.0] * n for _ in ids], [[0.0] * n for _ in ids], [0.0] * n
        )

    def add(self, sums: torch.Tensor) -> None:
        """Add `inner_products`' (2N+1, N) block."""
        n = len(self.ids)
        values = sums.tolist()
        for s in range(n):
            for t in range(n):
                self.gram[s][t] += values[s][t]
                self.owned[s][t] += values[n + s][t]
        for t in range(n):
            self.ram[t] += values[2 * n][t]


def changed_values(taus: torch.Tensor, epsilon: float) -> torch.Tensor:
    """τ·m: τ where |τ| > ε (the change mask's rule, kernel.change_mask), else 0.

    One fused step (hardshrink is exactly that rule for finite values), about
    three times cheaper than multiplying by the boolean mask.
    """
    return torch.nn.functional.hardshrink(taus, epsilon)


@torch.no_grad()
def inner_products(
    block: torch.Tensor, counts: torch.Tensor, epsilon: float
) -> torch.Tensor:
    """The (2N+1, N) float64 block Products.add takes, for one chunk.

    block (2N+1, n) float32 holds the N task vectors τ in its first rows, as
    task_vector makes them; counts (n,) the overlap count, as count_masks
    makes it. The other rows are filled here (owned, then RAM's merged τ at
    λ = 1); the caller reuses `block` for every chunk (allocating it anew
    costs more than the arithmetic). Rows of the result: gram, owned, ram
    (Products).
    """
    n = (block.shape[0] - 1) // 2
    taus = block[:n]
    changed = changed_values(taus, epsilon)
    unique = torch.eq(counts, 1, out=torch.empty_like(taus[0]))
    torch.mul(changed, unique, out=block[n : 2 * n])
    torch.sum(changed, 0, out=block[2 * n]).div_(counts.clamp(min=1))
    del changed
    # One matrix-vector product per task: faster than one matrix product here.
    columns = [torch.mv(block, taus[t]) for t in range(n)]
    return torch.stack(columns, dim=1).to("cpu", torch.float64)


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
