"""Inner products of task vectors, summed by the counting pass per tensor.

Asked for (`OverlapStatistics(inner_products=True)`, `mergekit-ram analyze`),
the pass that counts the change masks also sums, a chunk at a time, the few
inner products from which `analysis.regime.retentions` derives how much of
each task vector RAM, RAM+ and task arithmetic keep. They are summed here,
beside the counts, so that no second read of the models is needed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


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
