"""mergekit_ram.merge_tensors / merge_state_dicts against the dense reference."""

from __future__ import annotations

import copy
import os

import pytest
import reference
import torch
import yaml
from mergekit import merge_methods
from tensors import (
    EPSILON,
    as_dicts,
    assert_all_classes,
    cast,
    sparse_tasks,
    state_dicts,
    tensor_equal,
)

import mergekit_ram

TASK_IDS = ["coder", "tool", "memory"]
# Overlap differs from tensor to tensor, so whole-model λ ≠ per-tensor λ.
PROFILES = {
    "embed.weight": ((24, 16), [0.6, 0.6, 0.1]),
    "layers.0.weight": ((16, 16), [0.1, 0.3, 0.6]),
    "layers.0.bias": ((16,), [0.5, 0.1, 0.5]),
    "head.weight": ((8, 16), [0.05, 0.5, 0.5]),
}
# (method, parameters); reference.merge takes the parameters, with ramplus's r.
CONFIGS = [
    ("ram", {}),
    ("ramplus", {}),
    ("ramplus", {"saturation": "soft"}),
    ("ramplus", {"statistics": "tensor"}),
    ("ramplus", {"statistics": "tensor", "saturation": "soft"}),
    ("ramplus", {"r": 0.5, "alpha": 1.0}),
    ("ram", {"r": 0.3, "alpha": 5.0}),
    ("ramplus", {"r": 0.4, "alpha": 5.0, "statistics": "tensor"}),
]
CONFIG_IDS = [f"{m}-" + "-".join(f"{k}={v}" for k, v in p.items()) for m, p in CONFIGS]
DTYPES = [torch.float32, torch.bfloat16]


def ordered(base, tasks):
    """{id: model}, the base's id and the task ids."""
    return {"base": base, **dict(zip(TASK_IDS, tasks))}, "base", TASK_IDS


def reference_result(base, tasks, dtype=None, **kwargs):
    if dtype is not None:
        base = {k: v.to(dtype) for k, v in base.items()}
        tasks = [{k: v.to(dtype) for k, v in t.items()} for t in tasks]
    return reference.merge(base, tasks, **kwargs)


@pytest.fixture(params=[0, 1])
def model_set(request):
    base, tasks = state_dicts(PROFILES, seed=request.param)
    for name in base:
        assert_all_classes(base[name], [t[name] for t in tasks])
    return base, tasks


# --- merge_tensors --------------------------------------------------------------


def test_merge_tensors_ids_base_position_and_dtypes():
    base, tasks = sparse_tasks((10, 30), [0.4, 0.4, 0.4], seed=22)
    tensors = [tasks[0], tasks[1], base, tasks[2]]
    out = mergekit_ram.merge_tensors(
        tensors,
        "ramplus",
        parameters={"unique_scale": {"a": 1.5, "b": None, "c": None}},
        ids=["a", "b", "base", "c"],
        base_index=2,
        name="x",
    )
    merged, _ = reference.merge(
        *as_dicts(base, tasks), r=0.1, unique_scale=[1.5, None, None]
    )
    assert torch.equal(out, merged["w"])
    # dtype: converted before counting; out_dtype: the result rounded once.
    low = mergekit_ram.merge_tensors(
        [base, *tasks], "ramplus", base_index=0, dtype=torch.bfloat16
    )
    expected, _ = reference.merge(*as_dicts(*cast(base, tasks, torch.bfloat16)), r=0.1)
    assert tensor_equal(low, expected["w"])
    out = mergekit_ram.merge_tensors(
        [base, *tasks], "ramplus", base_index=0, out_dtype=torch.float16
    )
    full, _ = reference.merge(*as_dicts(base, tasks), r=0.1)
    assert tensor_equal(out, full["w"].to(torch.float16))


# --- merge_state_dicts: global vs tensor statistics --------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method,parameters", CONFIGS, ids=CONFIG_IDS)
def test_merge_state_dicts_and_tensors_equal_reference(
    model_set, method, parameters, dtype
):
    """Computed in float32, rounded once: equal to the reference of the
    inputs as given and of the inputs in float32, cast at the end.
    merge_tensors: one tensor is the whole call."""
    ref_kwargs = {"r": 0.1 if method == "ramplus" else 0.0, **parameters}
    base, tasks = model_set
    base = {k: v.to(dtype) for k, v in base.items()}
    tasks = [{k: v.to(dtype) for k, v in t.items()} for t in tasks]
    models, base_id, _ = ordered(base, tasks)
    out = mergekit_ram.merge_state_dicts(
        models, method, parameters=parameters, base=base_id
    )
    name = "layers.0.weight"
    alone = as_dicts(base[name], [t[name] for t in tasks])
    out_tensor = mergekit_ram.merge_tensors(
        [base[name], *(t[name] for t in tasks)],
        method,
        parameters=parameters,
        base_index=0,
    )
    expected, _ = reference.merge(base, tasks, **ref_kwargs)
    full, _ = reference_result(base, tasks, torch.float32, **ref_kwargs)
    one, _ = reference.merge(*alone, **ref_kwargs)
    one_full, _ = reference_result(*alone, torch.float32, **ref_kwargs)
    assert list(out) == list(base)
    for key in base:
        assert tensor_equal(out[key], expected[key]), key
        assert tensor_equal(out[key], full[key].to(dtype)), key
    assert tensor_equal(out_tensor, one["w"])
    assert tensor_equal(out_tensor, one_full["w"].to(dtype))


def test_state_dict_sequence_and_method_object(model_set):
    """A list of state dicts, the method as an object; the inputs unchanged."""
    from mergekit_ram.integration.methods import ramplus

    base, tasks = model_set
    kept = [{k: v.clone() for k, v in sd.items()} for sd in (base, *tasks)]
    out = mergekit_ram.merge_state_dicts(
        [*tasks[:1], base, *tasks[1:]], ramplus, base=1
    )
    expected, _ = reference.merge(base, tasks, r=0.1)
    assert all(torch.equal(out[name], expected[name]) for name in base)
    for sd, old in zip((base, *tasks), kept):
        assert all(torch.equal(sd[k], old[k]) for k in sd)


# --- explicit unique_scale -----------------------------------------------------


@pytest.mark.parametrize("method,r", [("ram", 0.0), ("ramplus", 0.1)])
@pytest.mark.parametrize("statistics", ["global", "tensor"])
@pytest.mark.parametrize(
    "unique_scale",
    [
        {"coder": 1.3, "tool": 0.9, "memory": 2.0},
        [1.3, 0.9, 2.0],
        {"coder": 1.4, "tool": None, "memory": None},
        {"coder": None, "tool": 1.25, "memory": None},
        [None, None, 1.6],
        1.35,
    ],
    ids=["all-map", "all-seq", "mix-first", "mix-middle", "mix-last", "scalar"],
)
def test_explicit_unique_scale(model_set, method, r, statistics, unique_scale):
    base, tasks = model_set
    models, base_id, task_ids = ordered(base, tasks)
    parameters = {"unique_scale": unique_scale, "statistics": statistics}
    out = mergekit_ram.merge_state_dicts(
        models, method, parameters=parameters, base=base_id
    )
    if isinstance(unique_scale, float):
        scales = [unique_scale] * len(tasks)  # one value broadcasts
    elif isinstance(unique_scale, dict):
        scales = [unique_scale.get(i) for i in task_ids]
    else:
        scales = list(unique_scale)
    expected, _ = reference.merge(
        base, tasks, r=r, statistics=statistics, unique_scale=scales
    )
    for name in base:
        assert torch.equal(out[name], expected[name]), name
    plain, _ = reference.merge(base, tasks, r=r, statistics=statistics)
    assert any(not torch.equal(out[n], plain[n]) for n in base)


def test_a_map_missing_a_task_model_is_mergekits_error(model_set):
    """Parameters are read as mergekit reads them: a map names every task."""
    base, tasks = model_set
    models, base_id, _ = ordered(base, tasks)
    parameters = {"unique_scale": {"tool": 1.25}}
    for merge in (mergekit_ram.merge_state_dicts, merge_methods.merge_state_dicts):
        with pytest.raises(ValueError, match="Missing unique_scale for input"):
            merge(models, "ramplus", parameters=parameters, base=base_id)


# --- dtype and out_dtype ------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs,dtype,out_dtype",
    [
        (torch.float32, torch.bfloat16, None),  # converted before counting
        (torch.bfloat16, torch.float32, None),  # float32, not rounded
        (torch.float32, None, torch.bfloat16),  # the float32 result, rounded once
        (torch.float32, torch.bfloat16, torch.float32),
    ],
)
def test_dtype_and_out_dtype(model_set, inputs, dtype, out_dtype):
    base, tasks = model_set
    base = {k: v.to(inputs) for k, v in base.items()}
    tasks = [{k: v.to(inputs) for k, v in t.items()} for t in tasks]
    models, base_id, _ = ordered(base, tasks)
    out = mergekit_ram.merge_state_dicts(
        models, "ramplus", base=base_id, dtype=dtype, out_dtype=out_dtype
    )
    expected, _ = reference_result(base, tasks, dtype, r=0.1, out_dtype=out_dtype)
    plain, _ = reference.merge(base, tasks, r=0.1)
    for name in base:
        assert tensor_equal(out[name], expected[name]), name
    assert any(not torch.equal(out[n], plain[n]) for n in base)


# --- torch.nn.Module inputs ---------------------------------------------------------


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(12, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.head = torch.nn.Linear(10, 6, bias=False)
        self.bn = torch.nn.BatchNorm1d(6)


def make_modules(seed: int, densities=((0.5, 0.05), (0.1, 0.6), (0.4, 0.4))):
    torch.manual_seed(seed)
    base = Net()
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for first, rest in densities:
        task = copy.deepcopy(base)
        with torch.no_grad():
            for index, p in enumerate(task.parameters()):
                density = first if index < 2 else rest
                mask = torch.rand(p.shape, generator=g) < density
                p.add_(torch.randn(p.shape, generator=g) * 0.01 * mask)
        tasks.append(task)
    return base, tasks


def plain(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize(
    "parameters,ref_kwargs",
    [
        ({}, {"r": 0.1}),
        ({"statistics": "tensor"}, {"r": 0.1, "statistics": "tensor"}),
    ],
    ids=["global", "tensor"],
)
def test_module_inputs(parameters, ref_kwargs, grad):
    base, tasks = make_modules(seed=31)
    kept = [plain(m) for m in (base, *tasks)]
    # Modules and a plain state dict, mixed.
    models = {"base": base, **dict(zip(TASK_IDS, tasks)), "tool": kept[2]}
    with torch.set_grad_enabled(grad):
        out = mergekit_ram.merge_state_dicts(
            models, "ramplus", parameters=parameters, base="base"
        )
    expected, _ = reference.merge(kept[0], kept[1:], **ref_kwargs)
    assert list(out) == list(kept[0])
    assert out["bn.num_batches_tracked"].dtype == torch.int64
    for name, tensor in out.items():
        assert tensor_equal(tensor.detach(), expected[name]), name
    for module, old in zip((base, *tasks), kept):
        assert all(torch.equal(v, old[k]) for k, v in module.state_dict().items())


# --- other API behaviour -------------------------------------------------------------


def test_epsilon_non_strict_and_other_methods(model_set):
    """epsilon is the statistics' threshold; strict=False counts the common
    tensors only; another method is mergekit's own."""
    base, tasks = model_set
    models, base_id, _ = ordered(base, tasks)
    out = mergekit_ram.merge_state_dicts(
        models, "ramplus", parameters={"epsilon": 5e-3}, base=base_id
    )
    expected, lam = reference.merge(base, tasks, r=0.1, epsilon=5e-3)
    _, default_lam = reference.merge(base, tasks, r=0.1, epsilon=EPSILON)
    assert lam != default_lam
    assert all(torch.equal(out[k], expected[k]) for k in base)
    ours = mergekit_ram.merge_state_dicts(
        models, "task_arithmetic", parameters={"weight": 0.5}, base=base_id
    )
    theirs = merge_methods.merge_state_dicts(
        models, "task_arithmetic", parameters={"weight": 0.5}, base=base_id
    )
    assert all(torch.equal(ours[k], theirs[k]) for k in base)
    extra = sparse_tasks((30, 30), [0.9], seed=3)[1][0]
    tasks = [dict(t) for t in tasks]
    tasks[0]["only.in.one"] = extra
    models, base_id, _ = ordered(base, tasks)
    out = mergekit_ram.merge_state_dicts(models, "ramplus", base=base_id, strict=False)
    common = [{k: t[k] for k in base} for t in tasks]
    expected, _ = reference.merge(base, common, r=0.1)
    assert list(out) == list(base)
    for name in base:
        assert torch.equal(out[name], expected[name]), name


def test_per_group_values_must_agree_for_global_statistics_and_base_required(
    model_set,
):
    base, tasks = model_set
    models, base_id, _ = ordered(base, tasks)
    with pytest.raises(ValueError, match="base"):
        mergekit_ram.merge_state_dicts(models, "ramplus")
    n = len(base)
    with pytest.raises(ValueError, match="'r' is 0.1 for tensor .* but 0.2 for"):
        mergekit_ram.merge_state_dicts(
            models,
            "ramplus",
            parameters={"r": merge_methods.PerGroupValues([0.1] * (n - 1) + [0.2])},
            base=base_id,
        )
    out = mergekit_ram.merge_state_dicts(
        models,
        "ramplus",
        parameters={"r": merge_methods.PerGroupValues([0.3] * n)},
        base=base_id,
    )
    expected, _ = reference.merge(base, tasks, r=0.3)
    assert all(torch.equal(out[k], expected[k]) for k in base)


@pytest.mark.parametrize("parameters", [None, {"r": 0.3, "alpha": 1.0}])
def test_mergekits_own_merge_state_dicts_is_global_ramplus(model_set, parameters):
    """Issue 35: the registered `ramplus` through mergekit's public API counts
    the whole call, so it equals ours and the dense whole-model reference."""
    base, tasks = model_set
    models, base_id, _ = ordered(base, tasks)
    theirs = merge_methods.merge_state_dicts(
        models, "ramplus", parameters=parameters, base=base_id
    )
    ours = mergekit_ram.merge_state_dicts(
        models, "ramplus", parameters=parameters, base=base_id
    )
    expected, _ = reference.merge(base, tasks, **(parameters or {"r": 0.1}))
    local, _ = reference.merge(base, tasks, r=0.1, statistics="tensor")
    assert all(torch.equal(theirs[k], ours[k]) for k in base)
    assert all(torch.equal(theirs[k], expected[k]) for k in base)
    assert any(not torch.equal(theirs[k], local[k]) for k in base)


def test_mergekits_own_merge_tensors_is_ramplus_of_that_tensor():
    """One tensor is the whole call: its own statistics, as ours."""
    base = torch.zeros(6)
    tasks = [torch.tensor([1.0, 1, 0, 0, 0, 0]), torch.tensor([1.0, 0, 1, 1, 0, 0])]
    theirs = merge_methods.merge_tensors([base, *tasks], "ramplus", base_index=0)
    ours = mergekit_ram.merge_tensors([base, *tasks], "ramplus", base_index=0)
    assert torch.equal(theirs, ours)
    # alpha: S/U = 1 → λ = 1.1; beta: S/U = 1/2 → λ = 1.05
    assert torch.allclose(theirs, torch.tensor([1.0, 1.1, 1.05, 1.05, 0, 0]))


@pytest.mark.parametrize("base_at", [0, 1])
def test_integer_base_is_kept_as_in_a_config_merge(base_at):
    """One rule for both paths (issue 17 item 9): a non-float base buffer is
    the output, as RAMMergeTask and merge_state_dicts keep it; mergekit's
    merge_tensors would promote it and merge 2.5 into it."""
    base = torch.arange(4)
    tensors = [torch.full((4,), 2.5)]
    tensors.insert(base_at, base)
    merged = mergekit_ram.merge_tensors(tensors, "ramplus", base_index=base_at)
    assert merged.dtype == torch.int64 and torch.equal(merged, base)
    assert merged.data_ptr() != base.data_ptr()
    states = mergekit_ram.merge_state_dicts(
        {"base": {"x": base}, "task": {"x": tensors[1 - base_at]}},
        "ramplus",
        base="base",
    )
    assert torch.equal(states["x"], merged)


@pytest.mark.parametrize("path", ["/models/a b", '/models/say "hi"', "/models/plain"])
def test_recipe_yaml_writes_any_model_path_back_as_it_parses(path):
    from mergekit.config import MergeConfiguration

    from mergekit_ram.commands.api import recipe_yaml

    config = MergeConfiguration.model_validate(
        {
            "merge_method": "ramplus",
            "base_model": f"{path}/base",
            "models": [
                {"model": f"{path}/alpha", "parameters": {"unique_scale": 1.5}},
                {"model": f"{path}/beta+{path}/lora"},
            ],
            "parameters": {"r": 0.2},
            "dtype": "bfloat16",
        }
    )
    text = recipe_yaml(config)
    assert MergeConfiguration.model_validate(yaml.safe_load(text)) == config
    if " " not in path and '"' not in path:
        assert text == config.to_yaml()  # mergekit's own text where it can write it


def test_mergekit_multi_merges_global_ramplus(family_f32, tmp_path):
    """mergekit-multi runs each stage through mergekit's run_merge: a ramplus
    stage gets whole-model λ, the same as ours (which takes a bytes path)."""
    from click.testing import CliRunner
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions
    from mergekit.scripts.multimerge import main as mergekit_multi

    mergekit_ram.install()
    document = family_f32.config_dict("ramplus", parameters={"r": 0.2})
    config = tmp_path / "multi.yml"
    config.write_text(yaml.safe_dump({"name": "final", **document}))
    stages = tmp_path / "stages"
    result = CliRunner().invoke(
        mergekit_multi, [str(config), "-I", str(stages), "--quiet"]
    )
    assert result.exit_code == 0, result.output
    ours = tmp_path / "ours"
    mergekit_ram.run_merge(
        MergeConfiguration.model_validate(document),
        os.fsencode(ours),
        MergeOptions(quiet=True),
    )
    for name in ("model.safetensors", "ram_statistics.json"):
        found = [p for p in stages.rglob(name)]
        assert len(found) == 1, list(stages.rglob("*"))
        if name.endswith(".safetensors"):
            assert found[0].read_bytes() == (ours / name).read_bytes()
