"""Property-based tests (hypothesis) of the RAM kernel, the counts and the λ rule.

Every property is a statement of docs/spec.md checked on generated inputs, not a
comparison with another implementation. Two kinds of merge case are drawn:

- grid cases: every value is an integer or half-integer multiple of a power of
  two (the unit), ε is exactly one unit, and an active task vector is c·d at an
  element c tasks change, so τ, τ/c and every sum in the merge are exact in
  float32 and representable in the input dtype (float32, bfloat16, float16).
  Properties that would otherwise need a tolerance (task order, the shared
  mean) are asserted bit for bit on these;
- float cases: arbitrary finite values of the dtype (±0, subnormals, huge
  magnitudes, perturbations at and next to ε), tasks stored in the base's dtype
  or in float32. Classes (unchanged / unique / shared) are taken from the
  spec's definition on the actual float32 τ, since storing base + perturbation
  rounds.

Examples are derandomized and no example database is used, so every run (CI
included) checks the same examples: 15 per property in the default run, 60 in
the slow one (RAM_HYPOTHESIS_PROFILE=ram-heavy). RAM_HYPOTHESIS_PROFILE=
ram-explore runs many more random ones.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensors import rule_fn

from mergekit_ram.core.counting import tensor_overlaps
from mergekit_ram.core.kernel import overlap_counts, ram_merge_tensor
from mergekit_ram.core.rule import ScaleRule

FIXED = dict(derandomize=True, database=None, deadline=None)
settings.register_profile("ram-ci", max_examples=15, **FIXED)
settings.register_profile("ram-heavy", max_examples=60, **FIXED)
settings.register_profile("ram-explore", deadline=None, max_examples=2000)
PROFILE = settings.get_profile(os.environ.get("RAM_HYPOTHESIS_PROFILE", "ram-ci"))

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F64 = torch.float64
U32 = 2.0**-24  # unit roundoff of float32
TINY32 = 2.0**-149  # smallest float32 subnormal: absolute error bound below 2^-126
MAX_SCALE = 17.0  # largest λ of the per-class cases: ScaleRule(r=4, alpha=4).limit()


@dataclass
class Case:
    base: torch.Tensor
    tasks: list[torch.Tensor]
    epsilon: float
    units: tuple | None = None  # grid cases: (unit, base units, [active d per task])

    @property
    def n(self) -> int:
        return len(self.tasks)


# --- strategies -----------------------------------------------------------


@st.composite
def layouts(draw, min_tasks=1):
    """(number of tasks, shape, per-element active-task masks).

    Elements 0-2 are forced to be unchanged, unique and (for ≥ 2 tasks)
    shared, so every grid case has all three classes (a float case keeps
    element 0 unchanged; rounding may undo a change elsewhere); the rest are
    drawn freely.
    """
    n, rows, cols = (draw(st.integers(*r)) for r in ((min_tasks, 5), (1, 3), (3, 8)))
    shape = (cols,) if rows == 1 else (rows, cols)
    active = [[draw(st.booleans()) for _ in range(n)] for _ in range(rows * cols)]
    lone = draw(st.integers(0, n - 1))
    active[:2] = [[False] * n, [t == lone for t in range(n)]]
    if n >= 2:
        pair = draw(st.permutations(range(n)))[:2]
        active[2] = [t in pair or a for t, a in enumerate(active[2])]
    return n, shape, active


# dtype: (largest |base| in units, range of the unit's exponent), chosen so that
# base + c·d (|d| ≤ 8, c ≤ 5) and half units stay exact in the dtype, and
# base + λ·d stays finite for λ ≤ 17.
GRID = {torch.float32: (2**16, -130, 100), torch.bfloat16: (64, -125, 100)}
GRID[torch.float16] = (512, -23, 6)


@st.composite
def grid_cases(draw, dtypes=DTYPES, min_tasks=1):
    dtype = draw(st.sampled_from(dtypes))
    n, shape, active = draw(layouts(min_tasks))
    limit, low, high = GRID[dtype]
    unit = 2.0 ** draw(st.integers(low, high))
    base_units = [draw(st.integers(-limit, limit)) for _ in active]
    d = [[0] * len(active) for _ in range(n)]
    task_units = [[0.0] * len(active) for _ in range(n)]
    for i, row in enumerate(active):
        c = sum(row)
        for t in range(n):
            if row[t]:
                d[t][i] = draw(st.integers(2, 8)) * draw(st.sampled_from([1, -1]))
                offset = c * d[t][i]
            else:  # unchanged, exactly ε (dropped: the test is strict) or ε/2
                offset = draw(st.sampled_from([0.0, 1.0, -1.0, 0.5, -0.5]))
            task_units[t][i] = base_units[i] + offset

    def tensor(values):
        exact = torch.tensor([v * unit for v in values], dtype=torch.float64)
        out = exact.to(dtype).reshape(shape)
        assert torch.equal(out.double().flatten(), exact)  # the grid is exact
        return out

    tasks = [tensor(row) for row in task_units]
    return Case(tensor(base_units), tasks, unit, (unit, base_units, d))


def finite_values(bound):
    """float32 values in [-bound, bound], the float strategy's edges included."""
    edges = [0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, 1.0, -1.0, bound, -bound]
    edges = st.sampled_from([v for v in edges if abs(v) <= bound])
    return st.floats(-bound, bound, width=32) | edges


@st.composite
def float_cases(draw, dtypes=DTYPES, max_scale=MAX_SCALE, min_tasks=1):
    """Arbitrary finite inputs; |θ| ≤ max/(4(1 + 2λ)) keeps base + λτ finite."""
    dtype = draw(st.sampled_from(dtypes))
    task_dtype = draw(st.sampled_from([dtype, torch.float32]))
    bound = float(torch.finfo(dtype).max) / (4 * (1 + 2 * max_scale))
    bound = float(torch.tensor(bound, dtype=torch.float32))
    n, shape, active = draw(layouts(min_tasks))
    room = min(1.0, bound / 4)  # leaves room for changes above ε
    special = [0.0, 1e-5, 2.0**-149, 2.0**-126, 1e-3, 0.25]
    special = st.sampled_from([e for e in special if e <= room])
    epsilon = draw(special | st.floats(0.0, room, width=32))
    near = [epsilon, -epsilon, math.nextafter(epsilon, 1.0)]
    base = torch.tensor([draw(finite_values(bound)) for _ in active]).to(dtype)
    base64 = base.double()
    rows = [[0.0] * len(active) for _ in range(n)]
    for i, row in enumerate(active):
        for t in range(n):
            if row[t]:  # above ε before storing (rounding may undo it)
                above = st.sampled_from([math.nextafter(epsilon, 1.0), 2 * epsilon])
                size = draw(st.floats(epsilon, bound, exclude_min=True) | above)
                perturbation = size * draw(st.sampled_from([1.0, -1.0]))
            elif i == 0:  # element 0 stays unchanged whatever the rounding
                perturbation = 0.0
            else:  # none, or at most ε
                below = st.floats(-epsilon, epsilon) | st.sampled_from(near[:2])
                perturbation = draw(st.just(0.0) | below)
            rows[t][i] = float(base64[i]) + perturbation
    tasks = [torch.tensor(row, dtype=F64).to(task_dtype).reshape(shape) for row in rows]
    return Case(base.reshape(shape), tasks, epsilon)


def cases(**kwargs):
    return grid_cases(**kwargs) | float_cases(**kwargs)


SATURATION = st.sampled_from(["clip", "soft"])
UP_TO_4 = st.floats(0.0, 4.0)
RULES = st.builds(ScaleRule, r=UP_TO_4, alpha=UP_TO_4, saturation=SATURATION)

HUGE = UP_TO_4 | st.floats(0.0, 1e150)  # r·α finite
# An element count: small (ties, ρ around α) or up to 2^63.
COUNT = st.integers(0, 20) | st.integers(0, 2**63)


@st.composite
def scalings(draw, n, max_scale=MAX_SCALE):
    """(per-task explicit scale or None, the rule for the Nones)."""
    rule = draw(RULES)
    explicit = st.none() | st.floats(0.0, max_scale) | st.just(1.0)
    return [draw(explicit) for _ in range(n)], rule


# --- helpers --------------------------------------------------------------


def merge(case: Case, scales, rule: ScaleRule) -> torch.Tensor:
    kwargs = dict(epsilon=case.epsilon, scales=scales, scale_fn=rule_fn(rule))
    return ram_merge_tensor(case.base, case.tasks, **kwargs)


def merged(case: Case, data, max_scale=MAX_SCALE):
    """(the merge under drawn scales and rule, the scales, the rule)."""
    scales, rule = data.draw(scalings(case.n, max_scale))
    return merge(case, scales, rule), scales, rule


def both_orders(case: Case, data):
    """The merge, and the merge of the tasks (and their scales) permuted."""
    out, scales, rule = merged(case, data)
    order = data.draw(st.permutations(range(case.n)))
    permuted = Case(case.base, [case.tasks[t] for t in order], case.epsilon)
    return out, merge(permuted, [scales[t] for t in order], rule)


def spec_counts(case: Case):
    """float32 base and τ, masks m and overlap counts c by the spec's definitions."""
    base32 = case.base.to(torch.float32)
    tau = torch.stack([t.to(torch.float32) - base32 for t in case.tasks])
    m = tau.abs() > case.epsilon
    return base32, tau, m, m.sum(0)


def spec_scales(m, c, scales, rule: ScaleRule) -> list[float]:
    """λ_t: the explicit value, else the rule on this tensor's S_t and U_t."""
    shared = [int((m[t] & (c >= 2)).sum()) for t in range(len(scales))]
    unique = [int(m[t].sum()) - shared[t] for t in range(len(scales))]
    rule_of = [rule.scale(s, u) for s, u in zip(shared, unique)]
    return [r if x is None else x for x, r in zip(scales, rule_of)]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def shared_tolerance(tau, m, c, out):
    """Bound on |kernel − (θ₀ + exact mean of the active τ)| at shared elements.

    The kernel forms q_t = fl(τ_t / c) (relative error ≤ u each), sums them
    in task order (≤ (c−1)·u·Σ|q_t|) and rounds θ₀ + Σ once (≤ u·|result|),
    so the error is ≤ c·u·A + u·|result| with A = Σ_active |τ_t| / c, to first
    order; below 2^-126 each of the c + 1 roundings adds at most 2^-149. The
    bound is doubled to cover second-order terms.
    """
    size = (tau.double().abs() * m).sum(0) / c.clamp(min=1)
    result = out.double().abs()
    return 2 * (c * U32 * size + U32 * result) + (c + 1) * TINY32


# --- task order -----------------------------------------------------------


@settings(PROFILE)
@given(grid_cases(), st.data())
def test_task_order_is_irrelevant_and_shared_the_exact_mean_on_a_grid(case, data):
    """Permuting the tasks and their scales alike changes nothing (exact sums).

    c ≥ 2: θ₀ + Σ_active τ_t / c, exact on the grid. Inactive tasks hold 0,
    ±ε or ±ε/2 there: counting them (dividing by N) or adding their
    sub-threshold τ would move the result off the expected grid value."""
    out, again = both_orders(case, data)
    assert torch.equal(out, again)
    unit, base_units, d = case.units
    _, _, _, c = spec_counts(case)
    mean_units = [b + sum(row[i] for row in d) for i, b in enumerate(base_units)]
    expected = torch.tensor([v * unit for v in mean_units], dtype=torch.float64)
    expected = expected.to(case.base.dtype).reshape(case.base.shape)
    shared = c >= 2
    assert shared.any() or case.n == 1
    assert torch.equal(out[shared], expected[shared])


@settings(PROFILE)
@given(float_cases(dtypes=[torch.float32], min_tasks=2), st.data())
def test_task_order_changes_only_rounding_of_three_way_sums(case, data):
    """On arbitrary float32 values the shared sum Σ fl(τ_t/c) is taken in task
    order, so only elements with c ≥ 3 may differ, each by at most the two
    results' distance to the exact mean (twice `shared_tolerance`). Unchanged,
    unique and two-way shared elements (a + b = b + a in IEEE) are identical.

    c ≥ 2: within `shared_tolerance` of θ₀ + (Σ_active τ_t)/c computed in
    float64 from the float32 τ.
    """
    out, again = both_orders(case, data)
    base32, tau, m, c = spec_counts(case)
    expected = base32.double() + (tau.double() * m).sum(0) / c.clamp(min=1)
    shared = c >= 2
    gap = (out.double() - expected).abs()[shared]
    bound = shared_tolerance(tau, m, c, out)[shared]
    assert bool((gap <= bound).all()), (gap - bound).max()
    few = c <= 2
    assert torch.equal(out[few], again[few])
    bound = shared_tolerance(tau, m, c, torch.maximum(out.abs(), again.abs()))
    gap = (out.double() - again.double()).abs()
    assert bool((gap <= 2 * bound).all()), (gap - 2 * bound).max()


# --- tasks identical to the base ------------------------------------------


@st.composite
def identical_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    task_dtype = draw(st.sampled_from([dtype, torch.float32]))
    biggest = float(torch.finfo(dtype).max)
    edges = [0.0, 1.0, biggest, -biggest, 2.0**-149, 2.0**-133, 2.0**-24]
    values = st.floats(-biggest, biggest, width=32) | st.sampled_from(edges)
    numel = draw(st.integers(1, 24))
    base = torch.tensor([draw(values) for _ in range(numel)]).to(dtype)
    n = draw(st.integers(1, 5))
    epsilon = draw(st.sampled_from([0.0, 1e-5, 2.0**-149, 1.0]))
    return Case(base, [base.to(task_dtype) for _ in range(n)], epsilon)


@settings(PROFILE)
@given(identical_cases(), st.data())
def test_tasks_equal_to_the_base_give_the_base_bit_for_bit(case, data):
    """τ = 0 everywhere: the result is the base, bit for bit, dtype included
    (−0.0 included)."""
    out, _, _ = merged(case, data, max_scale=1e6)
    assert out.dtype == case.base.dtype and out.shape == case.base.shape
    assert torch.equal(bits(out), bits(case.base))


# --- the merge rule, one class of element at a time ------------------------


@settings(PROFILE)
@given(cases(), st.data())
def test_unique_elements_are_base_plus_lambda_tau_unchanged_the_base(case, data):
    """c = 0 (every |τ| ≤ ε, sub-threshold noise included): θ₀ exactly.

    c = 1: exactly fl(θ₀ + fl(τ_t · λ_t)) in float32, cast once to the base
    dtype, λ_t explicit or from the rule on this tensor's own counts. The kernel
    multiplies a float32 τ by a Python float, which torch rounds to float32
    first; the expected value spells that rounding out."""
    out, scales, rule = merged(case, data)
    base32, tau, m, c = spec_counts(case)
    lambdas = spec_scales(m, c, scales, rule)
    for t, lam in enumerate(lambdas):
        mine = m[t] & (c == 1)
        lam32 = torch.tensor(lam, dtype=torch.float32)
        expected = (base32 + tau[t] * lam32).to(case.base.dtype)
        assert torch.equal(out[mine], expected[mine]), (t, lam)
    unchanged = c == 0
    assert unchanged.any()  # element 0 in every case
    assert torch.equal(out[unchanged], case.base[unchanged])
    assert torch.equal(bits(out)[unchanged], bits(case.base)[unchanged])


# --- counts against ε -----------------------------------------------------


@st.composite
def epsilon_pairs(draw, case: Case):
    """ε₁ ≤ ε₂, often exactly one of the case's |τ| values or its neighbour."""
    _, tau, _, _ = spec_counts(case)
    sizes = sorted({float(v) for v in tau.abs().flatten()})
    nearby = sizes + [math.nextafter(v, math.inf) for v in sizes]
    one = st.one_of(st.sampled_from(nearby), st.floats(0.0, 2.0))
    return tuple(sorted((draw(one), draw(one))))


def tails(histogram) -> list[int]:
    """Entry k: changed elements that at least k other tasks change too."""
    values = [int(v) for v in histogram]
    return [sum(values[k:]) for k in range(len(values))]


@settings(PROFILE)
@given(cases(dtypes=[torch.float32, torch.bfloat16]), st.data())
def test_raising_epsilon_never_increases_the_counts(case, data):
    """For ε₁ ≤ ε₂ every mask shrinks (m_t at ε₂ ⊆ m_t at ε₁), so these never grow:
    c_i per element, C_t, S_t, |m_s ∧ m_t|, and every tail Σ_{j≥k} of the k-way
    histogram. U_t = C_t − S_t is not among them (see the next test)."""
    low, high = data.draw(epsilon_pairs(case))
    base32 = case.base.to(torch.float32)
    counts = [overlap_counts(base32, case.tasks, e) for e in (low, high)]
    assert bool((counts[1] <= counts[0]).all())
    assert int((counts[1] == 0).sum()) >= int((counts[0] == 0).sum())

    overlaps = [tensor_overlaps(case.base, case.tasks, e) for e in (low, high)]
    (rows_low, pairs_low), (rows_high, pairs_high) = overlaps
    for t in range(case.n):
        assert all(a >= b for a, b in zip(tails(rows_low[t]), tails(rows_high[t])))
        for s in range(case.n):
            assert pairs_high[s][t] <= pairs_low[s][t]
        # the whole-tensor count agrees with the walk's histogram
        mask = (case.tasks[t].to(torch.float32) - base32).abs() > high
        row = [int((mask & (counts[1] == k + 1)).sum()) for k in range(case.n)]
        assert row == rows_high[t]


def test_raising_epsilon_can_increase_the_unique_count():
    """Why U_t is not asserted above: a shared element whose partner's change
    falls under the raised ε becomes unique for the other task."""
    base = torch.zeros(2)
    tasks = [torch.tensor([1.0, 0.0]), torch.tensor([1e-3, 0.0])]
    (rows_low, _), (rows_high, _) = (
        tensor_overlaps(base, tasks, e) for e in (1e-5, 1e-2)
    )
    assert rows_low[0] == [0, 1] and rows_high[0] == [1, 0]  # U₀: 0 → 1


# --- finiteness -----------------------------------------------------------


@st.composite
def extreme_cases(draw):
    """A rule with r, α up to 10³ (λ ≤ 1 + 10⁶) or explicit scales up to 10⁶,
    and inputs as large as base + λτ allows before the dtype itself overflows."""
    big = st.floats(0.0, 1e3) | st.sampled_from([0.0, 1e3])
    rule = draw(st.builds(ScaleRule, r=big, alpha=big, saturation=SATURATION))
    scales = [draw(st.none() | st.floats(0.0, 1e6)) for _ in range(5)]
    largest = max([rule.limit()] + [s for s in scales if s is not None])
    case = draw(float_cases(max_scale=largest))
    return case, scales[: case.n], rule


@settings(PROFILE)
@given(extreme_cases())
def test_finite_inputs_give_a_finite_result(drawn):
    """No NaN or Inf for finite inputs whose exact result the dtype can hold:
    |θ| ≤ max/(4(1 + 2λ_max)), subnormals, ±0, ε = 0 and |τ| at ε included."""
    case, scales, rule = drawn
    out = merge(case, scales, rule)
    assert bool(torch.isfinite(out).all())


# --- the RAM+ scale rule --------------------------------------------------


def rho(s: int, u: int):
    """ρ = S/U exactly: 0 for S = 0, ∞ for U = 0 < S."""
    return Fraction(0) if s == 0 else (math.inf if u == 0 else Fraction(s, u))


@settings(PROFILE)
@given(
    st.builds(ScaleRule, r=HUGE, alpha=HUGE, saturation=SATURATION),
    *[COUNT] * 4,
)
def test_scale_rule_is_bounded_and_monotone_in_rho(rule, s1, u1, s2, u2):
    """For finite r, α ≥ 0 (r·α finite): 1 ≤ λ ≤ limit() = 1 + r·α (clip) or
    1 + r (soft), λ = 1 when C = 0, λ = limit() when U = 0 < S, and λ is a
    non-decreasing function of ρ = S/U (so of S at fixed U) — both rules are
    monotone in ρ and every step (S/U, S/C, min, r·, 1+) rounds monotonically.
    """
    first, second = rule.scale(s1, u1), rule.scale(s2, u2)
    limit = rule.limit()
    assert math.isfinite(limit)
    assert limit == 1 + rule.r * (1.0 if rule.saturation == "soft" else rule.alpha)
    for lam, s, u in ((first, s1, u1), (second, s2, u2)):
        assert math.isfinite(lam) and 1.0 <= lam <= limit
        if s + u == 0:
            assert lam == 1.0
        if u == 0 and s > 0:
            assert lam == limit
    assert rule.scale(0, 0) == 1.0  # C = 0
    assert rule.scale(0, u1 + 1) == 1.0  # ρ = 0
    assert rule.scale(s1 + 1, 0) == limit  # U = 0 < S: never applied
    if rho(s1, u1) <= rho(s2, u2):
        assert first <= second
    if rho(s2, u2) <= rho(s1, u1):
        assert second <= first
    assert rule.scale(s1 + 1, u1) >= first  # one more shared element


@pytest.mark.slow
def test_every_property_on_the_heavy_profile():
    """This module's properties on 60 examples each instead of 15."""
    env = {**os.environ, "RAM_HYPOTHESIS_PROFILE": "ram-heavy"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:]
