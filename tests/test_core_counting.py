"""Overlap statistics (C, S, U, k-way histogram) against the dense reference."""

from __future__ import annotations

import contextlib
import math

import pytest
import reference
import torch
from tensors import EPSILON, as_dicts, cast, on, sparse_tasks, state_dicts

from mergekit_ram.core import counting
from mergekit_ram.core.checks import finite_inputs, finite_output
from mergekit_ram.core.counting import OverlapStatistics, group_tensors, tensor_overlaps
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.kernel import JOINT_LIMIT
from mergekit_ram.core.rule import ScaleRule

IDS = ["math", "code", "tools", "memory"]
PROFILES = {"embed": ((20, 8), [0.6, 0.5, 0.05, 0.3])}
PROFILES |= {"layer.0.weight": ((12, 12), [0.05, 0.3, 0.6, 0.2])}
PROFILES |= {
    "layer.0.bias": ((12,), [0.5] * 4),
    "head": ((3, 4, 5), [0.2, 0.05, 0.4, 0.7]),
}


def reference_stats(base, tasks):
    return reference.csu(reference.counts(base, tasks, EPSILON), len(tasks))


def collected(base, tasks, **options):
    stats = OverlapStatistics(epsilon=EPSILON, **options)
    for name in base:
        stats.add(name, base[name], {i: t[name] for i, t in zip(IDS, tasks)})
    return stats


@pytest.fixture
def torch_threads():
    """Set torch's CPU thread count for one test (restored after)."""
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


# (tasks, COUNT_CHUNK, threads)
CHUNKING = [(1, 1 << 18, 1), (3, 7, 3), (JOINT_LIMIT, 1, 3), (JOINT_LIMIT + 1, 7, 3)]


@pytest.mark.parametrize("n, chunk, threads", CHUNKING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counts_equal_reference(
    monkeypatch, torch_threads, n, chunk, threads, dtype, on_device
):
    # Up to JOINT_LIMIT tasks the counts come from one histogram of the masks'
    # joint pattern, above it from a product of the masks; COUNT_CHUNK
    # elements at a time, the chunks shared out among `threads` workers:
    # boundaries inside the tensor and between workers' runs, a last partial
    # chunk, a transposed (non-contiguous) task, and NaN / Inf elements (never
    # counted as changed by RAM's rule: NaN > ε is false; the pass's
    # nonfinite rule runs first).
    monkeypatch.setattr(counting, "COUNT_CHUNK", chunk)
    torch_threads(threads)
    densities = [0.1 + 0.08 * t for t in range(n)]
    base, tasks = cast(*sparse_tasks((13, 11), densities, seed=n), dtype)
    tasks[0] = tasks[0].clone()
    tasks[0][0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    tasks[-1] = tasks[-1].t().contiguous().t()  # same values, transposed storage
    assert not tasks[-1].is_contiguous()
    rows, pairs = tensor_overlaps(*on(on_device, base, tasks), EPSILON)
    per_tensor = reference.counts(*as_dicts(base, tasks), EPSILON)
    assert rows == reference.csu(per_tensor, n)[3]
    assert pairs == reference.intersections(per_tensor, n)
    empty = torch.zeros(0, dtype=dtype)
    assert tensor_overlaps(empty, [empty, empty], EPSILON) == ([[0, 0]] * 2,) * 2
    assert torch.get_num_threads() == threads  # the count restores it


@pytest.mark.parametrize("seed", [0, 1])
def test_totals_and_per_tensor_equal_reference(seed):
    base, tasks = state_dicts(PROFILES, seed=seed)
    stats = collected(base, tasks)
    elements = sum(b.numel() for b in base.values())
    assert list(stats.tasks) == IDS and list(stats.per_tensor) == list(PROFILES)
    assert (stats.num_tensors, stats.num_elements) == (len(base), elements)
    groups = [(stats.tasks, base)]
    groups += [(stats.per_tensor[k], {k: base[k]}) for k in base]
    for counted, part in groups:
        C, S, U, hist = reference_stats(part, [{k: t[k] for k in part} for t in tasks])
        for t, task_id in enumerate(IDS):
            counts = counted[task_id]
            assert counts.histogram == hist[t]
            assert (counts.changed, counts.shared, counts.unique) == (C[t], S[t], U[t])
            assert counts.elements == sum(b.numel() for b in part.values())
    hist = [stats.tasks[i].histogram for i in IDS]
    name = "layer.0.weight"  # counted twice: refused, and nothing changes
    with pytest.raises(ValueError, match=name):
        stats.add(name, base[name], {i: t[name] for i, t in zip(IDS, tasks)})
    assert [stats.tasks[i].histogram for i in IDS] == hist
    assert stats.num_tensors == len(base)


RULES = [(0.1, 2.0, "clip"), (0.5, 1.0, "clip"), (0.2, 0.3, "clip")]
RULES += [(0.1, 2.0, "soft"), (0.0, 2.0, "clip")]


@pytest.mark.parametrize("r, alpha, saturation", RULES)
def test_scales_equal_reference_global_lambda(r, alpha, saturation):
    rule = ScaleRule(r=r, alpha=alpha, saturation=saturation)
    base, tasks = state_dicts(PROFILES, seed=3)
    stats = collected(base, tasks)
    _, lam = reference.merge(base, tasks, r=r, alpha=alpha, saturation=saturation)
    scales = stats.scales(rule)
    assert list(scales) == IDS
    assert [scales[i] for i in IDS] == pytest.approx(lam, rel=1e-14)
    rho = min(stats.tasks[i].rho for i in IDS)
    if rule.r > 0 and (rule.saturation == "soft" or rule.alpha > rho):
        assert len(set(scales.values())) > 1  # not all clipped alike


def test_task_without_unique_elements():
    base = torch.zeros(6)
    a = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.0, 0.0])
    b = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])
    stats = OverlapStatistics(epsilon=EPSILON)
    stats.add("t", base, {"a": a, "b": b, "same": base.clone()})  # same: the base's
    found = stats.tasks
    assert found["a"].unique == 0 and found["a"].shared == 3 and found["b"].rho == 3.0
    assert found["a"].rho == math.inf
    assert found["same"].changed == 0 and found["same"].rho == 0.0
    rule = ScaleRule(r=0.1, alpha=2.0)
    scales = stats.scales(rule)
    assert scales == {"a": rule.limit(), "b": rule.scale(3, 1), "same": 1.0}


# --- checks on the way in and out (mergekit_ram.core.checks) ----------------------


def test_group_tensors_checks_layout_and_skips_buffers():
    base, (task,) = sparse_tasks((6, 4), [0.5], seed=7)
    group = group_tensors({"b": base, "t": task}, "b", ["b", "t"], None, name="w")
    assert group[0] is base and group[1] == {"t": task}
    buffers = {"b": torch.arange(3), "t": torch.arange(1, 4)}
    assert group_tensors(buffers, "b", "bt", None, name="i") is None
    wide = torch.zeros(7, 4)
    with pytest.raises(RAMInputError, match=r"tokenizer_source") as raised:
        group_tensors({"b": base, "t": wide}, "b", "bt", None, name="lm_head.weight")
    assert "(6, 4) in the base model b but (7, 4) in model t" in str(raised.value)
    for where in (dict(name="mlp.up_proj"), dict(name="w", vocabulary_axis=1)):
        with pytest.raises(RAMInputError, match="architecture"):
            group_tensors({"b": base, "t": wide}, "b", "bt", None, **where)


def test_finite_output_allows_nonfinite_kept_from_the_base(on_device):
    base = torch.tensor([1.0, math.inf], device=on_device)
    finite_output("t", base, base.clone())
    merged = torch.tensor([1e6, math.inf], device=on_device)
    with pytest.raises(RAMInputError, match="Merged tensor t has 1"):
        finite_output("t", base, merged.to(torch.float16))


def test_finite_check_survives_an_overflowing_sum():
    big = torch.full((64,), 60000.0, dtype=torch.float16)  # finite, sum overflows
    assert not torch.isfinite(big.sum())
    assert finite_inputs("w", "b", big, {"t": big}, "refuse") == {"t": big}


def test_ignore_counts_nonfinite_task_elements_as_unchanged():
    base, tasks = state_dicts(PROFILES, seed=8)
    poisoned = [{k: v.clone() for k, v in t.items()} for t in tasks]
    for t, state in enumerate(poisoned):
        flat = state["embed"].view(-1)
        flat[t] = math.nan
        flat[t + 10] = -math.inf
    stats = OverlapStatistics(epsilon=EPSILON)
    for name, b in base.items():
        inputs = {i: t[name] for i, t in zip(IDS, poisoned)}
        stats.add(name, b, finite_inputs(name, "b", b, inputs, "ignore"))
    healed = [
        {k: torch.where(torch.isfinite(v), v, base[k]) for k, v in t.items()}
        for t in poisoned
    ]
    *_, hist = reference_stats(base, healed)
    assert [stats.tasks[i].histogram for i in IDS] == hist
    inputs = {"math": poisoned[0]["embed"]}
    with pytest.raises(RAMInputError, match="model math has 1 NaN and 1 infinite"):
        finite_inputs("embed", "b", base["embed"], inputs, "refuse")


# --- order (OverlapStatistics.in_order) -------------------------------------------


def test_counted_in_any_order_then_put_in_order_equals_counted_in_order():
    base, tasks = state_dicts(PROFILES, seed=9)
    # "head" (last) lacks two tasks, so counting it first changes the task order.
    present = {name: IDS for name in base} | {"head": IDS[2:]}

    def counted(names):
        stats = OverlapStatistics(epsilon=EPSILON, inner_products=True)
        for name in names:
            inputs = {i: t[name] for i, t in zip(IDS, tasks) if i in present[name]}
            stats.add(name, base[name], inputs)
        return stats

    forward = counted(list(PROFILES))
    backward = counted(reversed(PROFILES))
    assert list(backward.tasks) != IDS  # what in_order has to undo
    backward.in_order(["not counted", *PROFILES])
    assert backward == forward
    assert list(backward.tasks) == list(forward.tasks) == IDS
    assert list(backward.per_tensor) == list(backward.products) == list(PROFILES)
    orders = [
        [list(c.intersections) for c in s.tasks.values()] for s in (forward, backward)
    ]
    assert orders[0] == orders[1]
    with pytest.raises(ValueError, match=r"\['head', 'layer.0.bias'\]"):
        forward.in_order(["embed", "layer.0.weight"])
    assert list(forward.per_tensor) == list(PROFILES)


FLOAT_MAX = torch.finfo(torch.float32).max


# The base's NaN reaches every τ; ∞ − ∞ is NaN; finite inputs whose τ
# overflows: a doubt only.
VALUES = [(0.5, 0.25, True), (math.nan, 0.25, False), (0.5, math.inf, False)]
VALUES += [(math.inf, math.inf, False), (FLOAT_MAX, -FLOAT_MAX, False)]


@pytest.mark.parametrize("base_value, task_value, finite", VALUES)
@pytest.mark.parametrize("chunk", [5, 1 << 16])
def test_count_tells_whether_every_task_vector_is_finite(
    monkeypatch, base_value, task_value, finite, chunk, on_device
):
    monkeypatch.setattr(counting, "COUNT_CHUNK", chunk)
    base, tasks = sparse_tasks((13, 11), [0.4, 0.3], seed=6)
    base[7, 3] = base_value
    tasks[1][7, 3] = task_value
    stats = OverlapStatistics(epsilon=EPSILON)
    on_base, on_tasks = on(on_device, base, tasks)
    assert stats.add("w", on_base, dict(zip(IDS, on_tasks))) is finite
    inputs = math.isfinite(base_value) and math.isfinite(task_value)
    refused = pytest.raises(RAMInputError, match="NaN")
    with contextlib.nullcontext() if inputs else refused:
        finite_inputs("w", "base", base, dict(zip(IDS, tasks)), "refuse")


# --- inner products (OverlapStatistics(inner_products=True)) ----------------------


@pytest.mark.parametrize("n", [3, JOINT_LIMIT + 1])
def test_products_equal_dense_reference(n):
    """gram, owned and RAM's products of float64 dense vectors, τ exactly at
    ±ε and just past it included (the change mask's rule)."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(60, generator=g) * 0.02
    base[:4] = 0.0
    tasks = []
    for _ in range(n):
        kept = torch.rand(60, generator=g) < 0.3
        delta = torch.randn(60, generator=g) * 0.05 * kept
        delta[:4] = torch.tensor([0.01, -0.01, 0.0101, -0.0101])
        tasks.append(base + delta)
    stats = OverlapStatistics(epsilon=1e-2, inner_products=True)
    stats.add("w", base, dict(enumerate(tasks)))
    products = stats.products["w"]
    merged, _ = reference.merge(*as_dicts(base, tasks), epsilon=1e-2)
    tau, m, c = reference.counts(*as_dicts(base, tasks), 1e-2)["w"]
    tau, delta = tau.double(), merged["w"].double() - base.double()
    for t in range(n):
        assert products.ram[t] == pytest.approx(float(delta @ tau[t]), rel=1e-5)
        for s in range(n):
            gram, owned = products.gram[s][t], products.owned[s][t]
            assert gram == pytest.approx(float(tau[s] @ tau[t]), rel=1e-5, abs=1e-12)
            mine = tau[s] * (m[s] & (c == 1))
            assert owned == pytest.approx(float(mine @ tau[t]), rel=1e-5, abs=1e-12)
