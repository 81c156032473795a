"""core.products: the inner products the counting pass sums, against the
change mask's rule and dense references (the retention they give is
tests/test_analysis_regime.py's)."""

from __future__ import annotations

import pytest
import reference
import torch

from mergekit_ram.core import counting, kernel
from mergekit_ram.core.counting import tensor_overlaps
from mergekit_ram.core.kernel import change_mask
from mergekit_ram.core.products import changed_values

EPSILON = 1e-2


@pytest.mark.parametrize("epsilon", [0.0, 1e-5, 0.5])
def test_changed_values_follow_the_change_mask(epsilon):
    # Exactly ±ε, just beyond it, zero and -0.0, tiny and large values.
    tiny = torch.finfo(torch.float32).tiny
    values = torch.tensor(
        [epsilon, -epsilon, 0.0, -0.0, tiny, -tiny, 1.0, -1.0, 3e-5, -3e-5]
    )
    values = torch.cat([values, torch.nextafter(values, values * 2)])
    changed = changed_values(values, epsilon)
    assert torch.equal(changed, values * change_mask(values, epsilon))


def test_many_tasks_use_the_pairwise_counts():
    # Above JOINT_LIMIT tasks the counts come from per-task histograms; the
    # products do not depend on which counting ran.
    n = kernel.JOINT_LIMIT + 1
    g = torch.Generator().manual_seed(4)
    base = torch.randn(40, generator=g) * 0.02
    tasks = [
        base + torch.randn(40, generator=g) * 0.05 * (torch.rand(40, generator=g) < 0.3)
        for _ in range(n)
    ]
    ids = list(range(n))
    rows, pairs, products = counting.overlaps_and_products(base, tasks, EPSILON, ids)
    assert (rows, pairs) == tensor_overlaps(base, tasks, EPSILON)
    merged, _ = reference.merge(
        {"w": base}, [{"w": t} for t in tasks], epsilon=EPSILON, out_dtype=torch.float32
    )
    delta = merged["w"].double() - base.double()
    for t, task in enumerate(tasks):
        tau = task.double() - base.double()
        assert products.ram[t] == pytest.approx(float(delta @ tau), rel=1e-5)
        for s, other in enumerate(tasks):
            gram = float((other.double() - base.double()) @ tau)
            assert products.gram[s][t] == pytest.approx(gram, rel=1e-5, abs=1e-12)
