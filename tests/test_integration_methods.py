"""`ram` / `ramplus` as mergekit merge methods: registration, parity, parameters."""

from __future__ import annotations

import math

import pydantic
import pytest
import reference
import torch
from mergekit import merge_methods
from mergekit.merge_methods import BasePolicy, ParameterScope
from mergekit.merge_methods import ram as stock_ram
from tensors import as_dicts, assert_all_classes, cast, on, sparse_tasks
from test_core_kernel import ref_merge

import mergekit_ram
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.methods import ram, ramplus

STOCK = stock_ram.ram_merge
F16 = torch.float16
CASES = [((50,), [0.5]), ((16, 24), [0.3, 0.4]), ((20, 12), [0.3, 0.4, 0.5])]
CASES += [((3, 8, 9), [0.2, 0.6, 0.4, 0.3])]


@pytest.fixture(params=range(len(CASES)), ids=lambda i: f"{len(CASES[i][1])}tasks")
def case(request, on_device):
    shape, densities = CASES[request.param]
    base, tasks = sparse_tasks(shape, densities, seed=100 + request.param)
    assert_all_classes(base, tasks)
    return on(on_device, base, tasks)


def through_mergekit(base, tasks, method="ramplus", **parameters):
    """mergekit's merge_tensors, the base first."""
    kwargs = dict(parameters=parameters, base_index=0)
    return merge_methods.merge_tensors([base, *tasks], method, **kwargs)


# --- parity with stock ram ----------------------------------------------------


@pytest.mark.parametrize("at", [0, 1])
@pytest.mark.parametrize("parameters", [None, {"epsilon": 1e-3}])
def test_ram_equals_stock_float32(case, parameters, at):
    base, tasks = case
    tensors = [*tasks[:at], base, *tasks[at:]]
    kwargs = dict(parameters=parameters, base_index=at)
    stock = merge_methods.merge_tensors(tensors, STOCK, **kwargs)
    ours = merge_methods.merge_tensors(tensors, "ram", **kwargs)
    assert ours.dtype == torch.float32 and ours.device == base.device
    assert torch.equal(ours, stock)
    assert torch.equal(mergekit_ram.merge_tensors(tensors, "ram", **kwargs), stock)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ram_low_precision_is_stock_float32_rounded_once(case, dtype):
    base, tasks = cast(*case, dtype)
    ours = through_mergekit(base, tasks, "ram")
    stock = through_mergekit(base.float(), [t.float() for t in tasks], STOCK)
    assert ours.dtype == dtype and torch.equal(ours, stock.to(dtype))
    if len(tasks) > 1:  # stock computes in the stored dtype; ours does not
        assert not torch.equal(ours, through_mergekit(base, tasks, STOCK))


def test_state_dicts_ram_equals_stock():
    """(Global RAM+ through mergekit's own merge_state_dicts: test_commands_api.)"""
    base, tasks = sparse_tasks((12, 16), [0.3, 0.4, 0.2], seed=5)
    bias, bias_tasks = sparse_tasks((16,), [0.5, 0.5, 0.5], seed=6)
    models = [{"w": w, "b": b} for w, b in zip([base, *tasks], [bias, *bias_tasks])]
    stock = merge_methods.merge_state_dicts(models, STOCK, base=0)
    ours = merge_methods.merge_state_dicts(models, "ram", base=0)
    assert stock.keys() == ours.keys() == {"w", "b"}
    assert all(torch.equal(ours[k], stock[k]) for k in stock)


# --- declared parameters ------------------------------------------------------


def test_spec_defaults():
    common = dict(epsilon=1e-5, alpha=2.0, saturation="clip", statistics="global")
    common.update(nonfinite="refuse", shared="mean", density=0.1, unique_scale=None)
    for method, name, r in ((ram, "ram", 0.0), (ramplus, "ramplus", 0.1)):
        spec = method.spec
        assert {p.name: p.default for p in spec.parameters} == {**common, "r": r}
        assert spec.name == name and spec.contract.base == BasePolicy.REQUIRED
        scopes = {p.name: p.scope for p in spec.parameters}
        assert scopes.pop("unique_scale") == ParameterScope.NON_BASE
        assert set(scopes.values()) == {ParameterScope.SHARED}
        assert spec.reference_url == "https://arxiv.org/abs/2601.13572"


BAD = [{"epsilon": -1e-6}, {"r": -0.1}, {"alpha": -1.0}, {"epsilon": math.nan}]
BAD += [{"r": math.nan}, {"alpha": math.nan}, {"r": math.inf}, {"saturation": "hard"}]
BAD += [{"statistics": "model"}, {"nonfinite": "skip"}, {"unique_scale": -1.0}]
BAD += [{"unique_scale": math.nan}]


@pytest.mark.parametrize(
    "bad", BAD, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items())
)
@pytest.mark.parametrize("name", ["ram", "ramplus"])
def test_invalid_parameters_are_rejected(bad, name):
    base, tasks = sparse_tasks((6, 6), [0.5, 0.5], seed=0)
    parameters = {"statistics": "tensor", **bad}
    for merge in (merge_methods.merge_tensors, mergekit_ram.merge_tensors):
        with pytest.raises(pydantic.ValidationError):
            merge([base, *tasks], name, parameters=parameters, base_index=0)


def test_unknown_parameter_is_rejected_and_a_base_required():
    base, tasks = sparse_tasks((6, 6), [0.5], seed=0)
    with pytest.raises(TypeError, match="lambda"):
        through_mergekit(base, tasks, "ram", **{"lambda": 1.2})
    with pytest.raises(ValueError, match="base"):
        merge_methods.merge_tensors([base, *tasks], "ram")


# --- statistics through mergekit's own entry points ------------------------------


def test_mergekits_merge_tensors_counts_its_one_tensor(case):
    """mergekit's merge_tensors with global RAM+ is whole-call RAM+, here one
    tensor: the dense reference's λ from that tensor; a given λ is kept."""
    base, tasks = case
    expected, lam = reference.merge(*as_dicts(base, tasks), r=0.1)
    assert torch.equal(through_mergekit(base, tasks), expected["w"])
    given = [1.5, *[None] * (len(tasks) - 1)]
    expected = ref_merge(base, tasks, r=0.1, unique_scale=[1.5, *lam[1:]])
    assert torch.equal(through_mergekit(base, tasks, unique_scale=given), expected)


# ramplus's defaults (r = 0.1, alpha = 2, clip), then given values.
RULES = [{}, {"saturation": "soft"}] + [
    dict(r=r, alpha=alpha, saturation=saturation)
    for r, alpha in ((0.1, 2.0), (0.5, 1.0))
    for saturation in ("clip", "soft")
]


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_tensor_scope_works_through_mergekit(case, rule):
    base, tasks = case
    out = through_mergekit(base, tasks, statistics="tensor", **rule)
    expected = ref_merge(base, tasks, statistics="tensor", **{"r": 0.1, **rule})
    assert torch.equal(out, expected)
    if len(tasks) > 1:
        assert not torch.equal(out, ref_merge(base, tasks))


def test_ramplus_without_statistics_and_epsilon_through_mergekit(case):
    base, tasks = case
    # r = 0 is plain RAM.
    assert torch.equal(through_mergekit(base, tasks, r=0.0), ref_merge(base, tasks))
    # Every task has an explicit λ: nothing to count.
    scales = [1.1 + 0.2 * i for i in range(len(tasks))]
    out = through_mergekit(base, tasks, unique_scale=scales)
    assert torch.equal(out, ref_merge(base, tasks, unique_scale=scales))
    # epsilon reaches the kernel
    out = through_mergekit(base, tasks, "ram", epsilon=4e-3)
    assert torch.equal(out, ref_merge(base, tasks, epsilon=4e-3))
    assert not torch.equal(out, ref_merge(base, tasks))


# --- inputs as they reach the kernel -------------------------------------------


def test_nonfinite_refused_or_ignored_through_mergekit(case):
    base, tasks = case
    poisoned = tasks[0].clone()
    poisoned.view(-1)[[7, 9]] = torch.tensor([math.nan, math.inf])
    tasks, params = [poisoned, *tasks[1:]], {"statistics": "tensor", "r": 0.2}
    with pytest.raises(RAMInputError, match="model 1 has 1 NaN and 1 infinite"):
        through_mergekit(base, tasks, **params)
    out = through_mergekit(base, tasks, **params, nonfinite="ignore")
    healed = torch.where(torch.isfinite(poisoned), poisoned, base)
    expected = ref_merge(base, [healed, *tasks[1:]], statistics="tensor", r=0.2)
    assert torch.equal(out, expected)


def test_overflow_of_the_output_dtype_is_refused(on_device):
    """λ·τ beyond float16 on one unique element: refused, naming how many."""
    base = torch.zeros(6, device=on_device)
    tasks = [
        torch.tensor([10.0, 0.0, 0.5, 0.0, 0.0, 0.0], device=on_device),
        torch.tensor([0.0, 0.25, 0.5, 0.0, 0.0, 0.0], device=on_device),
    ]
    kwargs = dict(parameters={"unique_scale": [60000.0, 1.0]}, base_index=0)
    with pytest.raises(RAMInputError, match="has 1 infinite or NaN values"):
        mergekit_ram.merge_tensors([base, *tasks], "ramplus", **kwargs, out_dtype=F16)
    kept = mergekit_ram.merge_tensors([base, *tasks], "ramplus", **kwargs)
    assert kept.device.type == on_device and kept[0] == 600000.0
