"""Which regime: expected overlaps and retention against dense references.

The expectations are checked against an exhaustive enumeration of independent
random supports; retention against RAM, RAM+ and task arithmetic merged
densely by tests/reference.py, with inner products taken over the dense
vectors. Epsilon is large here so that sub-threshold values carry weight in
the inner products (retention uses the full task vectors). The counting
pass's chunked products (core.counting.Products) are checked here too, against whole
tensors and for the thread count they run with.
"""

from __future__ import annotations

import itertools

import pytest
import reference
import torch

from mergekit_ram.analysis.regime import METHODS, expected, jaccard, ratio, retentions
from mergekit_ram.core import counting
from mergekit_ram.core.counting import OverlapStatistics, tensor_overlaps
from mergekit_ram.core.rule import ScaleRule

EPSILON = 1e-2
F32 = torch.float32
IDS = ["code", "tools", "memory"]
# name: (shape, each task's density): densities differ from tensor to tensor.
PROFILES = {"embed": ((30, 8), [0.6, 0.1, 0.3])}
PROFILES |= {"layer.0.weight": ((16, 16), [0.05, 0.5, 0.4])}
PROFILES |= {"layer.0.bias": ((9,), [0.3, 0.3, 0.9])}


def models(seed: int = 0, identical: int | None = None):
    """float32 base and task state dicts with unique, shared and unchanged
    elements, sub-threshold noise everywhere and, for task 0, sub-threshold
    values that follow task 1's sign where task 1 changes an element."""
    g = torch.Generator().manual_seed(seed)
    base, tasks = {}, [{} for _ in IDS]
    for name, (shape, densities) in PROFILES.items():
        base[name] = b = torch.randn(shape, generator=g) * 0.02
        deltas = []
        for density in densities:
            keep = torch.rand(shape, generator=g) < density
            change = torch.randn(shape, generator=g) * 0.05 + 0.03
            noise = (torch.rand(shape, generator=g) - 0.5) * 0.016
            deltas.append(torch.where(keep, change, noise))
        follow = (deltas[0].abs() <= EPSILON) & (deltas[1].abs() > EPSILON)
        deltas[0] = torch.where(follow, 0.006 * deltas[1].sign(), deltas[0])
        for t, delta in enumerate(deltas):
            tasks[t][name] = b.clone() if t == identical else b + delta
    return base, tasks


def counted(base, tasks, inner_products=True):
    stats = OverlapStatistics(epsilon=EPSILON, inner_products=inner_products)
    for name in base:
        stats.add(name, base[name], {i: t[name] for i, t in zip(IDS, tasks)})
    return stats


def dense_retention(base, tasks, merged, full=True):
    """⟨τ_merged, τ_t⟩ / ⟨τ_t, τ_t⟩ in float64 over the whole model; with
    full=False τ_t is cut to its changed elements (what a shortcut that
    ignores sub-threshold values would compute)."""
    out = []
    for task in tasks:
        num = den = 0.0
        for name in base:
            tau = task[name].double() - base[name].double()
            tau = tau if full else tau * (tau.abs() > EPSILON)
            num += float((merged[name] * tau).sum())
            den += float((tau * tau).sum())
        out.append(num / den if den else None)
    return out


def dense_merges(base, tasks, epsilon=EPSILON, **ramplus):
    """Merged task vectors (float64) of every method, densely; `ramplus`:
    reference.merge's options for RAM+."""

    def ram(**options):
        merged, _ = reference.merge(base, tasks, **common, **options)
        return {k: merged[k].double() - base[k].double() for k in base}

    common = dict(epsilon=epsilon, out_dtype=F32)
    total = {k: sum(t[k].double() - base[k].double() for t in tasks) for k in base}
    mean = {k: v / len(tasks) for k, v in total.items()}
    return {"ram": ram(), "ramplus": ram(**ramplus), "ta_mean": mean, "ta_sum": total}


def lambdas(per_tensor, rule):
    """Each task's λ from these dense counts."""
    C, S, U, _ = reference.csu(per_tensor, len(IDS))
    terms = (rule.r, rule.alpha, rule.saturation)
    return {i: reference.lam(C[t], S[t], U[t], *terms) for t, i in enumerate(IDS)}


RULES = [(0.1, 2.0, "clip", "global"), (0.3, 0.5, "clip", "global")]
RULES += [(0.2, 2.0, "soft", "global"), (0.1, 2.0, "clip", "tensor")]


@pytest.mark.parametrize("r, alpha, saturation, statistics", RULES)
def test_retention_equals_dense_merges(r, alpha, saturation, statistics):
    base, tasks = models()
    stats = counted(base, tasks)
    rule = ScaleRule(r=r, alpha=alpha, saturation=saturation)
    per_tensor = reference.counts(base, tasks, EPSILON)
    local = dict.fromkeys(base, lambdas(per_tensor, rule))
    if statistics == "tensor":  # per tensor, each task's λ from its dense counts
        local = {name: lambdas({name: c}, rule) for name, c in per_tensor.items()}
    ours = retentions([(stats.products[name], local[name]) for name in base], IDS)
    assert list(ours) == list(METHODS)
    rule = dict(r=r, alpha=alpha, saturation=saturation, statistics=statistics)
    for method, vector in dense_merges(base, tasks, **rule).items():
        want = dense_retention(base, tasks, vector)
        assert [ours[method][i] for i in IDS] == pytest.approx(want, rel=1e-5)
        # The sub-threshold values matter here: a masked τ_t would be wrong.
        shortcut = dense_retention(base, tasks, vector, full=False)
        assert max(abs(a / b - 1) for a, b in zip(shortcut, want)) > 1e-3
    # RAM keeps more of each task than averaging; RAM+ more than RAM.
    for i in IDS:
        assert ours["ramplus"][i] > ours["ram"][i] > ours["ta_mean"][i]


def test_retention_of_a_task_equal_to_the_base_is_undefined():
    base, tasks = models(seed=1, identical=1)
    ours = retentions([(p, {}) for p in counted(base, tasks).products.values()], IDS)
    for method in METHODS:
        assert ours[method]["tools"] is None and ours[method]["code"] is not None
    assert retentions([], IDS) == {m: dict.fromkeys(IDS) for m in METHODS}


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_pass_equals_whole_tensors(monkeypatch, chunk):
    base, tasks = models(seed=2)
    whole = counted(base, tasks)
    monkeypatch.setattr(counting, "PRODUCT_CHUNK", chunk)
    chunked = counted(base, tasks)
    plain = counted(base, tasks, inner_products=False)
    assert plain.products == {}
    for name in base:
        rows, pairs = tensor_overlaps(base[name], [t[name] for t in tasks], EPSILON)
        for t, i in enumerate(IDS):
            assert chunked.per_tensor[name][i].histogram == rows[t]
            assert plain.per_tensor[name][i] == chunked.per_tensor[name][i]
        a, b = whole.products[name], chunked.products[name]
        assert a.ids == b.ids == IDS
        for row_a, row_b in zip([*a.gram, *a.owned, a.ram], [*b.gram, *b.owned, b.ram]):
            assert row_a == pytest.approx(row_b, rel=1e-5, abs=1e-9)


def test_expectations_are_means_over_independent_supports():
    # Each task changes a uniformly random subset of each tensor, of its
    # observed size, independently: enumerate every outcome.
    tensors = [(4, [2, 1, 3]), (5, [1, 4, 2]), (3, [0, 3, 1])]
    inter, alone = [[0.0] * 3 for _ in range(3)], [0.0] * 3
    for n, sizes in tensors:
        subsets = [[set(c) for c in itertools.combinations(range(n), k)] for k in sizes]
        outcomes = list(itertools.product(*subsets))
        for supports in outcomes:
            for s in range(3):
                others = set().union(*(supports[o] for o in range(3) if o != s))
                alone[s] += len(supports[s] - others) / len(outcomes)
                for t in range(3):
                    inter[s][t] += len(supports[s] & supports[t]) / len(outcomes)
    inter_e, alone_e = expected(tensors, 3)
    assert [*inter_e, alone_e] == [pytest.approx(w, rel=1e-12) for w in [*inter, alone]]
    # Per tensor, not whole model: the whole-model formula differs here.
    total = sum(n for n, _ in tensors)
    changed = [sum(sizes[t] for _, sizes in tensors) for t in range(3)]
    assert inter_e[0][1] != pytest.approx(changed[0] * changed[1] / total)


def test_ratio_and_jaccard_edges():
    assert (ratio(6, 3.0), ratio(0, 0.0), jaccard(0, 0, 0)) == (2.0, None, 0.0)
    assert jaccard(2.0, 4, 6) == pytest.approx(0.25)
