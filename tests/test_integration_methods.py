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

import mergekit_ram
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.methods import ram, ramplus

STOCK = stock_ram.ram_merge
CASES = [
    ((50,), [0.5]),
    ((16, 24), [0.3, 0.4]),
    ((20, 12), [0.3, 0.4, 0.5]),
    ((3, 8, 9), [0.2, 0.6, 0.4, 0.3]),
]


@pytest.fixture(params=range(len(CASES)), ids=lambda i: f"{len(CASES[i][1])}tasks")
def case(request, on_device):
    shape, densities = CASES[request.param]
    base, tasks = sparse_tasks(shape, densities, seed=100 + request.param)
    assert_all_classes(base, tasks)
    return on(on_device, base, tasks)


def ref_merge(base, tasks, **kwargs):
    merged, _ = reference.merge(*as_dicts(base, tasks), **kwargs)
    return merged["w"]


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
    tensors = [base, *tasks]
    ours = merge_methods.merge_tensors(tensors, "ram", base_index=0)
    upcast = [t.float() for t in tensors]
    stock = merge_methods.merge_tensors(upcast, STOCK, base_index=0)
    assert ours.dtype == dtype
    assert torch.equal(ours, stock.to(dtype))
    if len(tasks) > 1:
        # Stock computes in the stored dtype; ours does not.
        in_dtype = merge_methods.merge_tensors(tensors, STOCK, base_index=0)
        assert not torch.equal(ours, in_dtype)


def test_state_dicts_ram_equals_stock_and_ramplus_counts_the_whole_call():
    """RAM equals stock on state dicts; global RAM+ through mergekit's own
    in-memory merge (and ours) counts the whole call, as the dense reference
    counts the model."""
    base, tasks = sparse_tasks((12, 16), [0.3, 0.4, 0.2], seed=5)
    bias, bias_tasks = sparse_tasks((16,), [0.5, 0.5, 0.5], seed=6)
    models = [{"w": base, "b": bias}] + [
        {"w": t, "b": b} for t, b in zip(tasks, bias_tasks)
    ]
    stock = merge_methods.merge_state_dicts(models, STOCK, base=0)
    ours = merge_methods.merge_state_dicts(models, "ram", base=0)
    assert stock.keys() == ours.keys() == {"w", "b"}
    assert all(torch.equal(ours[k], stock[k]) for k in stock)
    expected, _ = reference.merge(models[0], models[1:], r=0.1)
    for merge in (merge_methods.merge_state_dicts, mergekit_ram.merge_state_dicts):
        merged = merge(models, "ramplus", base=0)
        assert merged.keys() == expected.keys()
        assert all(torch.equal(merged[k], expected[k]) for k in expected)


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


def test_ramplus_defaults_are_used(case):
    base, tasks = case
    tensors = [base, *tasks]
    out = merge_methods.merge_tensors(
        tensors, "ramplus", parameters={"statistics": "tensor"}, base_index=0
    )
    expected = ref_merge(base, tasks, r=0.1, alpha=2.0, statistics="tensor")
    assert torch.equal(out, expected)
    if len(tasks) > 1:
        assert not torch.equal(out, ref_merge(base, tasks))


BAD = [
    {"epsilon": -1e-6},
    {"r": -0.1},
    {"alpha": -1.0},
    {"epsilon": math.nan},
    {"r": math.nan},
    {"alpha": math.nan},
    {"r": math.inf},
    {"saturation": "hard"},
    {"statistics": "model"},
    {"nonfinite": "skip"},
    {"unique_scale": -1.0},
    {"unique_scale": math.nan},
]


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


def test_unknown_parameter_is_rejected():
    base, tasks = sparse_tasks((6, 6), [0.5, 0.5], seed=0)
    with pytest.raises(TypeError, match="lambda"):
        merge_methods.merge_tensors(
            [base, *tasks], "ram", parameters={"lambda": 1.2}, base_index=0
        )


def test_base_is_required():
    base, tasks = sparse_tasks((6, 6), [0.5, 0.5], seed=0)
    with pytest.raises(ValueError, match="base"):
        merge_methods.merge_tensors([base, *tasks], "ram")


# --- global statistics through mergekit's own entry points ---------------------


def test_mergekits_merge_tensors_counts_its_one_tensor(case):
    """mergekit's merge_tensors with global RAM+ is whole-call RAM+, here one
    tensor: the dense reference's λ from that tensor; a given λ is kept."""
    base, tasks = case
    state = ({"w": base}, [{"w": t} for t in tasks])
    merged = merge_methods.merge_tensors([base, *tasks], "ramplus", base_index=0)
    expected, lam = reference.merge(*state, r=0.1)
    assert torch.equal(merged, expected["w"])
    given = [1.5, *[None] * (len(tasks) - 1)]
    merged = merge_methods.merge_tensors(
        [base, *tasks], "ramplus", parameters={"unique_scale": given}, base_index=0
    )
    expected, _ = reference.merge(*state, r=0.1, unique_scale=[1.5, *lam[1:]])
    assert torch.equal(merged, expected["w"])


@pytest.mark.parametrize("saturation", ["clip", "soft"])
@pytest.mark.parametrize("r,alpha", [(0.1, 2.0), (0.5, 1.0)])
def test_tensor_scope_works_through_mergekit(case, saturation, r, alpha):
    base, tasks = case
    parameters = {"statistics": "tensor", "saturation": saturation, "r": r}
    parameters["alpha"] = alpha
    out = merge_methods.merge_tensors(
        [base, *tasks], "ramplus", parameters=parameters, base_index=0
    )
    expected = ref_merge(
        base, tasks, r=r, alpha=alpha, saturation=saturation, statistics="tensor"
    )
    assert torch.equal(out, expected)


def test_ramplus_without_statistics_and_epsilon_through_mergekit(case):
    base, tasks = case
    tensors = [base, *tasks]
    # r = 0 is plain RAM.
    out = merge_methods.merge_tensors(
        tensors, "ramplus", parameters={"r": 0.0}, base_index=0
    )
    assert torch.equal(out, ref_merge(base, tasks))
    # Every task has an explicit λ: nothing to count.
    scales = [1.1 + 0.2 * i for i in range(len(tasks))]
    out = merge_methods.merge_tensors(
        tensors, "ramplus", parameters={"unique_scale": scales}, base_index=0
    )
    assert torch.equal(out, ref_merge(base, tasks, unique_scale=scales))
    # epsilon reaches the kernel
    out = merge_methods.merge_tensors(
        [base, *tasks], "ram", parameters={"epsilon": 4e-3}, base_index=0
    )
    assert torch.equal(out, ref_merge(base, tasks, epsilon=4e-3))
    assert not torch.equal(out, ref_merge(base, tasks))


# --- inputs as they reach the kernel -------------------------------------------


def test_nonfinite_refused_or_ignored_through_mergekit(case):
    base, tasks = case
    poisoned = tasks[0].clone()
    poisoned.view(-1)[[7, 9]] = torch.tensor([math.nan, math.inf])
    tensors = [base, poisoned, *tasks[1:]]
    params = {"statistics": "tensor", "r": 0.2}
    with pytest.raises(RAMInputError, match="model 1 has 1 NaN and 1 infinite"):
        merge_methods.merge_tensors(tensors, "ramplus", parameters=params, base_index=0)
    out = merge_methods.merge_tensors(
        tensors, "ramplus", parameters={**params, "nonfinite": "ignore"}, base_index=0
    )
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
    parameters = {"unique_scale": [60000.0, 1.0]}
    with pytest.raises(RAMInputError, match="has 1 infinite or NaN values"):
        mergekit_ram.merge_tensors(
            [base, *tasks],
            "ramplus",
            parameters=parameters,
            base_index=0,
            out_dtype=torch.float16,
        )
    kept = mergekit_ram.merge_tensors(
        [base, *tasks], "ramplus", parameters=parameters, base_index=0
    )
    assert kept.device.type == on_device and kept[0] == 600000.0


def test_integer_base_passes_through_the_kernel():
    base = torch.tensor([2**40 + 3, -5, 0], dtype=torch.int64)
    out = merge_methods.merge_tensors([base, base * 2], "ram", base_index=0)
    assert out.dtype == torch.int64 and torch.equal(out, base)
    assert out.data_ptr() != base.data_ptr()
