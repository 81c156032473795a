"""Small seeded test inputs for RAM: base tensors plus sparse task deltas.

Task models are base + sparse deltas with controlled overlap (independently
random models would make every element shared). A few fixed positions hold
the edge cases every case must contain: deltas of exactly ±epsilon and of
5e-6 (dropped), an element only one task changes although another task has a
sub-threshold delta there, and a shared element next to a sub-threshold delta.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EPSILON = 1e-5


def sparse_tasks(
    shape: Sequence[int],
    densities: Sequence[float],
    *,
    seed: int,
    scale: float = 0.01,
    epsilon: float = EPSILON,
    edges: bool = True,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """float32 base and one task tensor per density (fraction of changed elements)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tuple(shape), generator=g)
    deltas = []
    for density in densities:
        mask = torch.rand(base.shape, generator=g) < density
        deltas.append(torch.randn(base.shape, generator=g) * scale * mask)
    if edges and base.numel() >= 6:
        _set_edges(base, deltas, epsilon)
    return base, [base + d for d in deltas]


def _set_edges(base: torch.Tensor, deltas: list[torch.Tensor], epsilon: float):
    """Fixed edge cases at flat positions 0-5 (base is 0 there, so τ is exact)."""
    flat_base = base.view(-1)
    flat = [d.view(-1) for d in deltas]
    flat_base[:6] = 0.0
    for d in flat:
        d[:6] = 0.0
    n = len(flat)
    flat[0][0] = epsilon  # exactly ε: dropped
    flat[0][1] = -epsilon  # exactly −ε: dropped
    flat[n - 1][2] = 5e-6  # sub-threshold: dropped
    flat[0][3] = 0.25  # unique for task 0 ...
    if n > 1:
        flat[n - 1][3] = 5e-6  # ... next to sub-threshold noise
        flat[0][4] = 0.5  # shared by tasks 0 and 1 ...
        flat[1][4] = -0.125
        if n > 2:
            flat[2][4] = epsilon  # ... and not by task 2 (divisor 2, not 3)
        flat[1][5] = 0.75  # unique for task 1


def cast(base: torch.Tensor, tasks: Sequence[torch.Tensor], dtype: torch.dtype):
    return base.to(dtype), [t.to(dtype) for t in tasks]


def assert_all_classes(base, tasks, epsilon: float = EPSILON) -> None:
    """The case exercises every branch of the merge rule (unchanged, unique
    and shared elements, and dropped sub-threshold deltas)."""
    tau = torch.stack([t.float() - base.float() for t in tasks])
    m = tau.abs() > epsilon
    c = m.sum(0)
    assert (c == 0).any() and (c == 1).any()  # unchanged, unique
    assert ((tau != 0) & ~m).any()  # sub-threshold deltas, dropped
    assert len(tasks) == 1 or (c >= 2).any()  # shared
    if base.dtype == torch.float32 and base.numel() >= 6:
        assert (tau.abs() == torch.tensor(epsilon)).any()  # exactly ε, dropped


def on(device: str, base: torch.Tensor, tasks: Sequence[torch.Tensor]):
    """base and tasks moved to `device` (the `on_device` fixture's value)."""
    return base.to(device), [t.to(device) for t in tasks]


def as_dicts(base: torch.Tensor, tasks: Sequence[torch.Tensor], name: str = "w"):
    """The one-tensor state dicts reference.merge takes."""
    return {name: base}, [{name: t} for t in tasks]


def state_dicts(profiles: dict, *, seed: int, scale: float = 0.01):
    """Base and task state dicts; profiles: name -> (shape, per-task densities)."""
    n = len(next(iter(profiles.values()))[1])
    base: dict[str, torch.Tensor] = {}
    tasks: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    for index, (name, (shape, densities)) in enumerate(profiles.items()):
        b, ts = sparse_tasks(shape, densities, seed=seed * 1000 + index, scale=scale)
        base[name] = b
        for t in range(n):
            tasks[t][name] = ts[t]
    return base, tasks


def tensor_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, dtype included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def rule_fn(rule, calls: list | None = None):
    """The kernel's scale_fn: `rule` (a ScaleRule) on this tensor's k-way
    histogram; each call's (index, histogram) is noted in `calls`."""

    def scale_fn(index, histogram):
        if calls is not None:
            calls.append((index, histogram.clone()))
        unique = int(histogram[0])
        return rule.scale(int(histogram.sum()) - unique, unique)

    return scale_fn
