"""core.kernel's merge and count against the dense reference (docs/spec.md)."""

from __future__ import annotations

import math

import pytest
import reference
import tensors
import torch
from tensors import EPSILON, as_dicts, cast, on, rule_fn, sparse_tasks

from mergekit_ram.core import kernel
from mergekit_ram.core.kernel import JOINT_LIMIT, overlaps, ram_merge_tensor
from mergekit_ram.core.rule import ScaleRule

CASES = [((64,), [0.4]), ((16, 24), [0.3, 0.3]), ((12, 10), [0.2, 0.5, 0.4])]
CASES += [((4, 6, 10), [0.4, 0.1, 0.3, 0.6])]
EXPLICIT = [1.3, 0.75, 2.0, 1.05]
FLOAT_MAX = float(torch.finfo(torch.float32).max)


def ref_merge(base, tasks, **kwargs):
    merged, _ = reference.merge(*as_dicts(base, tasks), **kwargs)
    return merged["w"]


@pytest.fixture(params=range(len(CASES)), ids=lambda i: f"{len(CASES[i][1])}tasks")
def case(request, on_device):
    shape, densities = CASES[request.param]
    base, tasks = sparse_tasks(shape, densities, seed=request.param)
    tensors.assert_all_classes(base, tasks)
    return on(on_device, base, tasks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [[1.0] * 4, EXPLICIT, [FLOAT_MAX] * 4])
def test_ram_and_explicit_scales_equal_reference(case, scales, dtype):
    """Λ is λ_t on task t's unique elements and exactly 1 elsewhere, even where
    the λ of the tasks sharing an element would overflow float32 summed."""
    base, tasks = cast(*case, dtype)
    before = [t.clone() for t in (base, *tasks)]
    scales = scales[: len(tasks)]
    out = ram_merge_tensor(base, tasks, epsilon=EPSILON, scales=scales)
    assert out.dtype == dtype and out.device == base.device
    assert torch.equal(out, ref_merge(base, tasks, unique_scale=scales))
    assert_untouched(before, (base, *tasks), out)


def assert_untouched(before, inputs, out):
    """Inputs are never written (nor their dtype changed), nor returned."""
    for old, new in zip(before, inputs):
        assert new.dtype == old.dtype and torch.equal(old, new)
    assert out.data_ptr() not in {t.data_ptr() for t in inputs}


@pytest.mark.parametrize("saturation", ["clip", "soft"])
@pytest.mark.parametrize("first", [None, 1.7])
def test_scale_fn_is_tensor_local_statistics(case, saturation, first):
    base, tasks = case
    n = len(tasks)
    rule = dict(r=0.5, alpha=1.5, saturation=saturation)
    calls, before = [], [t.clone() for t in (base, *tasks)]
    fn, scales = rule_fn(ScaleRule(**rule), calls), [first] + [None] * (n - 1)
    out = ram_merge_tensor(base, tasks, epsilon=EPSILON, scales=scales, scale_fn=fn)
    want = ref_merge(base, tasks, **rule, statistics="tensor", unique_scale=scales)
    assert torch.equal(out, want)
    assert_untouched(before, (base, *tasks), out)
    # scale_fn sees each task without a scale once, in order, with this
    # tensor's k-way histogram.
    *_, hist = reference.csu(reference.counts(*as_dicts(base, tasks), EPSILON), n)
    assert [index for index, _ in calls] == list(range(first is not None, n))
    assert [histogram.tolist() for _, histogram in calls] == [hist[i] for i, _ in calls]


F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32), (F32, BF16), (F64, F64)]


@pytest.mark.parametrize("base_dtype,task_dtype", PAIRS)
def test_returns_base_dtype(base_dtype, task_dtype):
    base, tasks = sparse_tasks((10, 10), [0.3, 0.3], seed=7)
    base, tasks = base.to(base_dtype), [t.to(task_dtype) for t in tasks]
    out = ram_merge_tensor(base, tasks, epsilon=EPSILON, scales=[1.2, 1.0])
    assert out.dtype == base_dtype and out.shape == base.shape
    assert torch.equal(out, ref_merge(base, tasks, unique_scale=[1.2, 1.0]))
    # Tensors without data (the meta device) merge to a tensor without data.
    meta = ram_merge_tensor(*on("meta", base, tasks), epsilon=EPSILON, scales=[1, 1])
    assert meta.device.type == "meta" and meta.shape == base.shape


def test_zero_tasks_returns_a_copy_of_base_and_each_task_needs_a_scale():
    base, tasks = sparse_tasks((4, 4), [0.5, 0.5], seed=1)
    out = ram_merge_tensor(base, [], epsilon=EPSILON, scales=[])
    assert torch.equal(out, base) and out.dtype == base.dtype
    assert_untouched([base.clone()], [base], out)
    with pytest.raises(ValueError, match="2 task tensors but 1 scales"):
        ram_merge_tensor(base, tasks, epsilon=EPSILON, scales=[1.0])


# docs/spec.md, "Worked example".
TAU = [[0.5, 0, 0.2, 0, 0, 0.3, 5e-6, 0], [0, 0.4, 0.4, 0, 0, -0.1, 0, 0]]
TAU += [[0, 0, 0.6, 0.7, 0, 0, 0, 1e-6]]
RAM_ROW = [0.5, 0.4, 0.4, 0.7, 0, 0.1, 0, 0]


def worked(rule: ScaleRule):
    base, tasks, calls = torch.zeros(8), [torch.tensor(row) for row in TAU], []
    fn = rule_fn(rule, calls)
    out = ram_merge_tensor(base, tasks, epsilon=1e-5, scales=[None] * 3, scale_fn=fn)
    return base, tasks, out, calls, [rule_fn(rule)(i, h) for i, h in calls]


WORKED = [(0.0, 2.0, [1.0, 1.0, 1.0], RAM_ROW)]
WORKED += [(0.1, 2.0, [1.2, 1.2, 1.1], [0.6, 0.48, 0.4, 0.77, 0, 0.1, 0, 0])]
WORKED += [(0.1, 1.0, [1.1, 1.1, 1.1], [0.55, 0.44, 0.4, 0.77, 0, 0.1, 0, 0])]


@pytest.mark.parametrize("r,alpha,lambdas,row", WORKED)
def test_worked_example_ram_and_clip(r, alpha, lambdas, row):
    base, tasks, out, calls, got = worked(ScaleRule(r=r, alpha=alpha))
    # c = [1, 1, 3, 1, 0, 2, 0, 0]; S = [2, 2, 1]; U = [1, 1, 1]
    assert [h.tolist() for _, h in calls] == [[1, 1, 1], [1, 1, 1], [1, 0, 1]]
    assert got == pytest.approx(lambdas, abs=1e-12)
    assert torch.allclose(out, torch.tensor(row), rtol=0, atol=1e-6)
    want = ref_merge(base, tasks, r=r, alpha=alpha, statistics="tensor")
    assert torch.equal(out, want)


def test_worked_example_soft():
    base, tasks, out, _, got = worked(ScaleRule(r=0.1, alpha=2.0, saturation="soft"))
    assert got == pytest.approx([1 + 0.2 / 3, 1 + 0.2 / 3, 1.05], rel=1e-12)
    # Unique elements carry λ·τ, shared ones the plain mean, the rest stay 0.
    lam = torch.tensor(got, dtype=torch.float32)
    assert out[[0, 1, 3]].tolist() == (torch.tensor([0.5, 0.4, 0.7]) * lam).tolist()
    rest = [2, 4, 5, 6, 7]
    assert torch.equal(out[rest], worked(ScaleRule(0, 2))[2][rest])
    want = ref_merge(base, tasks, r=0.1, saturation="soft", statistics="tensor")
    assert torch.allclose(out, want, rtol=0, atol=1e-7)


def mergekit_order(base32, tasks, epsilon, scales):
    """θ₀ + Σ_t where(m_t, τ_t/c (·λ_t if unique), −0.0), summed from −0.0 in
    task order: the float32 steps of stock mergekit's `ram`, signs of zero
    included."""
    tau = [task.float() - base32 for task in tasks]
    masks = [t.abs() > epsilon for t in tau]
    counts = sum(m.int() for m in masks)
    delta = torch.full_like(base32, -0.0)
    for t, m, scale in zip(tau, masks, scales):
        q = t / counts.clamp(min=1).float()
        q = torch.where(counts == 1, q * torch.tensor(scale), q)
        delta = delta + torch.where(m, q, torch.tensor(-0.0))
    return base32 + delta


@pytest.mark.parametrize("scales", [[1.0] * 3, [1.5, 0.25, 1.0], [3e38, 1.0, 0.5]])
def test_zero_signs_follow_mergekit_bit_for_bit(monkeypatch, scales, on_device):
    """Bases of −0.0 and +0.0 next to unchanged, sub-ε, cancelling (x − x =
    +0.0) and, with ε = 0, underflowing (τ/c rounds to ±0) elements; chunks
    with and without a −0.0 base; a λ near float32's largest (its unique
    elements overflow to ∞, nothing else touched)."""
    monkeypatch.setattr(kernel, "MERGE_CHUNK", 4)
    tiny = 2.0**-149
    base = torch.tensor([-0.0, 0.0, -0.0, -0.0, 1.0, 0.0, 2.0, 3.0, -0.0, -0.0, 0.5])
    deltas = [
        [0.0, 0.0, 0.5, tiny, 0.0, -tiny, 0.25, 0.0, -0.0, 1e-30, 0.125],
        [0.0, -0.0, -0.5, tiny, 0.0, tiny, -0.25, 0.0, 0.0, -1e-30, 0.0],
        [-0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0, 0.0],
    ]
    tasks = [base + torch.tensor(d) for d in deltas]
    inputs = on(on_device, base, tasks)
    for epsilon in (0.0, 1e-5):
        out = ram_merge_tensor(*inputs, epsilon=epsilon, scales=scales).cpu()
        want = mergekit_order(base, tasks, epsilon, scales)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), epsilon
    assert out[0].item() == 0.0 and str(out[0].item()) == "-0.0"
    assert out[10] == 0.5 + 0.125 * torch.tensor(scales[0])  # unique to task 0


@pytest.mark.parametrize("scales", [[1.0, 1.0], [1.5, 2.0]])
def test_nonfinite_base_kept_where_every_task_took_its_value(scales, on_device):
    """What `nonfinite: ignore` hands the kernel: where the base is NaN or ±∞
    every task holds the base's value, so τ is NaN there: unchanged for
    every task, and the base's value is written; the rest merges as usual."""
    base = torch.tensor([math.inf, math.nan, -math.inf, 1.0, 2.0, 3.0])
    ends = [[1.5, 2.0, 3.25], [1.0, 2.5, 3.75]]
    tasks = [torch.cat([base[:3], torch.tensor(end)]) for end in ends]
    out = ram_merge_tensor(*on(on_device, base, tasks), epsilon=EPSILON, scales=scales)
    out, want = out.cpu(), mergekit_order(base, tasks, EPSILON, scales)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert out[0] == math.inf and out[1].isnan() and out[2] == -math.inf
    assert out[3] == 1.0 + 0.5 * scales[0] and out[5] == 3.5


# None: every τ finite, no second look; "beside -0.0": the signed-zero step
# keeps the doubt.
NONFINITE = [(None, None), ("task", math.nan), ("task", math.inf)]
NONFINITE += [("base", -math.inf), ("beside -0.0", math.nan)]


@pytest.mark.parametrize("where, value", NONFINITE)
def test_the_walk_says_when_some_tau_is_not_finite(
    monkeypatch, where, value, on_device
):
    """Refusing, the merge reads no input again unless its own sums of τ say
    so (once per tensor, whichever chunk and worker saw it)."""
    monkeypatch.setattr(kernel, "MERGE_CHUNK", 64)
    base, tasks = sparse_tasks((37, 29), [0.4, 0.3, 0.5], seed=7)
    if where in ("task", "beside -0.0"):
        tasks[1].view(-1)[500] = value
    if where == "beside -0.0":
        base.view(-1)[501] = tasks[0].view(-1)[501] = tasks[2].view(-1)[501] = -0.0
    elif where == "base":
        base.view(-1)[900] = value
    calls, scales = [], [1.2, 1.0, 1.1]
    told = dict(epsilon=EPSILON, scales=scales, on_nonfinite=lambda: calls.append(1))
    ram_merge_tensor(*on(on_device, base, tasks), **told)
    assert calls == ([1] if where else [])


@pytest.mark.parametrize("n", [1, 3, 4, JOINT_LIMIT, 13])
@pytest.mark.parametrize("chunk", [1 << 12, 1 << 18])
def test_counts_of_a_large_tensor_equal_reference(n, chunk, on_device):
    """From 2^16 elements on the count reads several elements' patterns as
    one number; a chunk that does not divide into pieces (a run's last,
    narrower than the rows) counts one pattern a number. Beyond JOINT_LIMIT
    (13 task models: more than the 12 bits a packed number holds) no
    patterns are packed."""
    base, tasks = sparse_tasks((256, 263), [0.1 + 0.08 * t for t in range(n)], seed=n)
    rows, pairs, finite, _ = overlaps(*on(on_device, base, tasks), EPSILON, chunk)
    per_tensor = reference.counts(*as_dicts(base, tasks), EPSILON)
    assert rows == reference.csu(per_tensor, n)[3]
    assert pairs == reference.intersections(per_tensor, n) and finite
