"""mergekit_ram.merge_tensors / merge_state_dicts against the dense reference."""

from __future__ import annotations

import copy
import os

import pytest
import reference
import tensors
import torch
import yaml
from mergekit import merge_methods
from tensors import as_dicts, sparse_tasks, state_dicts, tensor_equal

import mergekit_ram

TASK_IDS = ["coder", "tool", "memory"]
F32, BF16 = torch.float32, torch.bfloat16
# Overlap differs from tensor to tensor, so whole-model λ ≠ per-tensor λ.
PROFILES = {"embed.weight": ((24, 16), [0.6, 0.6, 0.1])}
PROFILES |= {"layers.0.weight": ((16, 16), [0.1, 0.3, 0.6])}
PROFILES |= {"layers.0.bias": ((16,), [0.5, 0.1, 0.5])}
PROFILES |= {"head.weight": ((8, 16), [0.05, 0.5, 0.5])}
# (method, parameters); reference.merge takes the parameters, with ramplus's r.
CONFIGS = [("ram", {}), ("ramplus", {}), ("ramplus", {"saturation": "soft"})]
CONFIGS += [("ramplus", {"statistics": "tensor"})]
CONFIGS += [("ramplus", {"statistics": "tensor", "saturation": "soft"})]
CONFIGS += [("ramplus", {"r": 0.5, "alpha": 1.0}), ("ram", {"r": 0.3, "alpha": 5.0})]
CONFIGS += [("ramplus", {"r": 0.4, "alpha": 5.0, "statistics": "tensor"})]
CONFIG_IDS = [f"{m}-" + "-".join(f"{k}={v}" for k, v in p.items()) for m, p in CONFIGS]


def converted(base, tasks, dtype):
    """The state dicts in `dtype` (None: as they are)."""

    def to(state):
        return state if dtype is None else {k: v.to(dtype) for k, v in state.items()}

    return to(base), [to(t) for t in tasks]


def named(base, tasks) -> dict:
    """{id: model}: the base under "base", then the tasks."""
    return {"base": base, **dict(zip(TASK_IDS, tasks))}


def equal(out, expected, keys) -> bool:
    return all(torch.equal(out[k], expected[k]) for k in keys)


def merged(models, method="ramplus", merge=mergekit_ram.merge_state_dicts, **options):
    """merge_state_dicts (ours or `merge`) of {id: model} with the base "base"."""
    return merge(models, method, base="base", **options)


def ref(base, tasks, **kwargs):
    """The dense reference's merged state."""
    return reference.merge(base, tasks, **kwargs)[0]


@pytest.fixture(params=[0, 1])
def model_set(request):
    base, tasks = state_dicts(PROFILES, seed=request.param)
    for name in base:
        tensors.assert_all_classes(base[name], [t[name] for t in tasks])
    return base, tasks


def test_merge_tensors_ids_base_position_and_dtypes():
    base, tasks = sparse_tasks((10, 30), [0.4, 0.4, 0.4], seed=22)
    scales = {"unique_scale": {"a": 1.5, "b": None, "c": None}}
    options = dict(ids=["a", "b", "base", "c"], base_index=2, name="x")
    given = [*tasks[:2], base, tasks[2]]
    out = mergekit_ram.merge_tensors(given, "ramplus", parameters=scales, **options)
    expected = ref(*as_dicts(base, tasks), r=0.1, unique_scale=[1.5, None, None])
    assert torch.equal(out, expected["w"])
    # dtype: converted before counting; out_dtype: the result rounded once.
    whole = dict(method="ramplus", base_index=0)
    low = mergekit_ram.merge_tensors([base, *tasks], **whole, dtype=BF16)
    low_inputs = as_dicts(*tensors.cast(base, tasks, BF16))
    assert tensor_equal(low, ref(*low_inputs, r=0.1)["w"])
    out = mergekit_ram.merge_tensors([base, *tasks], **whole, out_dtype=torch.float16)
    full = ref(*as_dicts(base, tasks), r=0.1)["w"]
    assert tensor_equal(out, full.to(torch.float16))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("method,parameters", CONFIGS, ids=CONFIG_IDS)
def test_merge_state_dicts_and_tensors_equal_reference(
    model_set, method, parameters, dtype
):
    """Computed in float32, rounded once: equal to the reference of the
    inputs as given and of the inputs in float32, cast at the end.
    merge_tensors: one tensor is the whole call."""
    ref_kwargs = {"r": 0.1 if method == "ramplus" else 0.0, **parameters}
    base, tasks = converted(*model_set, dtype)
    name = "layers.0.weight"
    out = merged(named(base, tasks), method, parameters=parameters)
    given = [base[name], *(t[name] for t in tasks)]
    one = mergekit_ram.merge_tensors(given, method, parameters=parameters, base_index=0)
    assert list(out) == list(base)
    alone = as_dicts(base[name], [t[name] for t in tasks])
    for inputs, got in (((base, tasks), out), (alone, {"w": one})):
        expected = ref(*inputs, **ref_kwargs)
        full = ref(*converted(*inputs, torch.float32), **ref_kwargs)
        for key in got:
            assert tensor_equal(got[key], expected[key]), key
            assert tensor_equal(got[key], full[key].to(dtype)), key


# All given (a map, a sequence), some (first, middle, last), one for all.
SCALES = [{"coder": 1.3, "tool": 0.9, "memory": 2.0}, [1.3, 0.9, 2.0]]
SCALES += [{"coder": 1.4, "tool": None, "memory": None}, [None, None, 1.6], 1.35]
SCALES += [{"coder": None, "tool": 1.25, "memory": None}]


@pytest.mark.parametrize("method,r", [("ram", 0.0), ("ramplus", 0.1)])
@pytest.mark.parametrize("statistics", ["global", "tensor"])
@pytest.mark.parametrize("unique_scale", SCALES, ids=str)
def test_explicit_unique_scale(model_set, method, r, statistics, unique_scale):
    base, tasks = model_set
    parameters = {"unique_scale": unique_scale, "statistics": statistics}
    out = merged(named(base, tasks), method, parameters=parameters)
    if isinstance(unique_scale, float):
        scales = [unique_scale] * len(tasks)  # one value broadcasts
    elif isinstance(unique_scale, dict):
        scales = [unique_scale.get(i) for i in TASK_IDS]
    else:
        scales = list(unique_scale)
    expected = ref(base, tasks, r=r, statistics=statistics, unique_scale=scales)
    assert equal(out, expected, base)
    assert not equal(out, ref(base, tasks, r=r, statistics=statistics), base)


# Converted before counting; float32, not rounded; the float32 result rounded once.
DTYPES = [(F32, BF16, None), (BF16, F32, None), (F32, None, BF16), (F32, BF16, F32)]


@pytest.mark.parametrize("inputs,dtype,out_dtype", DTYPES)
def test_dtype_and_out_dtype(model_set, inputs, dtype, out_dtype):
    base, tasks = converted(*model_set, inputs)
    out = merged(named(base, tasks), dtype=dtype, out_dtype=out_dtype)
    expected = ref(*converted(base, tasks, dtype), r=0.1, out_dtype=out_dtype)
    for name in base:
        assert tensor_equal(out[name], expected[name]), name
    assert not equal(out, ref(base, tasks, r=0.1), base)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(12, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.head = torch.nn.Linear(10, 6, bias=False)
        self.bn = torch.nn.BatchNorm1d(6)


def plain(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("statistics", ["global", "tensor"])
def test_module_inputs(statistics, grad):
    torch.manual_seed(31)
    base, g = Net(), torch.Generator().manual_seed(31)
    tasks = [copy.deepcopy(base) for _ in TASK_IDS]
    with torch.no_grad():
        for task, (first, rest) in zip(tasks, ((0.5, 0.05), (0.1, 0.6), (0.4, 0.4))):
            for index, p in enumerate(task.parameters()):
                mask = torch.rand(p.shape, generator=g) < (first if index < 2 else rest)
                p.add_(torch.randn(p.shape, generator=g) * 0.01 * mask)
    kept = [plain(m) for m in (base, *tasks)]
    # Modules and a plain state dict, mixed.
    models = {**named(base, tasks), "tool": kept[2]}
    with torch.set_grad_enabled(grad):
        out = merged(models, parameters={"statistics": statistics})
    expected = ref(kept[0], kept[1:], r=0.1, statistics=statistics)
    assert list(out) == list(kept[0])
    assert out["bn.num_batches_tracked"].dtype == torch.int64
    for name, tensor in out.items():
        assert tensor_equal(tensor.detach(), expected[name]), name
    for module, old in zip((base, *tasks), kept):
        assert equal(module.state_dict(), old, old)


def test_other_options_and_how_mergekit_reads_parameters(model_set):
    """A list of state dicts with the method as an object, the inputs
    unchanged; epsilon is the statistics' threshold; strict=False counts the
    common tensors only; another method is mergekit's own. Parameters are read
    as mergekit reads them: a map names every task, a per-group value must
    agree for global statistics, and a base is required."""
    from mergekit_ram.integration.methods import ramplus

    base, tasks = model_set
    models = named(base, tasks)
    kept = [{k: v.clone() for k, v in sd.items()} for sd in (base, *tasks)]
    out = mergekit_ram.merge_state_dicts([tasks[0], base, *tasks[1:]], ramplus, base=1)
    expected, default_lam = reference.merge(base, tasks, r=0.1)
    assert equal(out, expected, base)
    for sd, old in zip((base, *tasks), kept):
        assert equal(sd, old, sd)
    out = merged(models, parameters={"epsilon": 5e-3})
    expected, lam = reference.merge(base, tasks, r=0.1, epsilon=5e-3)
    assert lam != default_lam and equal(out, expected, base)
    both = (mergekit_ram.merge_state_dicts, merge_methods.merge_state_dicts)
    arithmetic = dict(method="task_arithmetic", parameters={"weight": 0.5})
    assert equal(*(merged(models, **arithmetic, merge=m) for m in both), base)
    extra = [dict(t) for t in tasks]
    extra[0]["only.in.one"] = sparse_tasks((30, 30), [0.9], seed=3)[1][0]
    out = merged(named(base, extra), strict=False)
    assert list(out) == list(base) and equal(out, ref(base, tasks, r=0.1), base)
    for merge in both:
        with pytest.raises(ValueError, match="Missing unique_scale for input"):
            merged(models, parameters={"unique_scale": {"tool": 1.25}}, merge=merge)
    with pytest.raises(ValueError, match="base"):
        mergekit_ram.merge_state_dicts(models, "ramplus")
    values = merge_methods.PerGroupValues([0.1] * (len(base) - 1) + [0.2])
    with pytest.raises(ValueError, match="'r' is 0.1 for tensor .* but 0.2 for"):
        merged(models, parameters={"r": values})
    values = merge_methods.PerGroupValues([0.3] * len(base))
    out = merged(models, parameters={"r": values})
    assert equal(out, ref(base, tasks, r=0.3), base)


@pytest.mark.parametrize("parameters", [None, {"r": 0.3, "alpha": 1.0}])
def test_mergekits_own_merge_state_dicts_is_global_ramplus(model_set, parameters):
    """The registered `ramplus` through mergekit's public API counts the
    whole call, so it equals ours and the dense whole-model reference."""
    base, tasks = model_set
    ours, theirs = (
        merged(named(base, tasks), parameters=parameters, merge=merge)
        for merge in (mergekit_ram.merge_state_dicts, merge_methods.merge_state_dicts)
    )
    expected = ref(base, tasks, **(parameters or {"r": 0.1}))
    local = ref(base, tasks, r=0.1, statistics="tensor")
    assert equal(theirs, ours, base) and equal(theirs, expected, base)
    assert not equal(theirs, local, base)


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
    """One rule for every path: a non-float base buffer is the output, as
    RAMMergeTask and merge_state_dicts keep it; mergekit's merge_tensors would
    promote it and merge 2.5 into it (ours passes it through the kernel)."""
    base = torch.tensor([2**40 + 3, -5, 0, 4])
    given = [torch.full((4,), 2.5)]
    given.insert(base_at, base)
    ours = mergekit_ram.merge_tensors(given, "ramplus", base_index=base_at)
    states = merged({"base": {"x": base}, "task": {"x": given[1 - base_at]}})
    assert torch.equal(states["x"], ours)
    routed = merge_methods.merge_tensors([base, base * 2], "ram", base_index=0)
    for out in (ours, routed):
        assert out.dtype == torch.int64 and torch.equal(out, base)
        assert out.data_ptr() != base.data_ptr()


@pytest.mark.parametrize("path", ["/models/a b", '/models/say "hi"', "/models/plain"])
def test_recipe_yaml_writes_any_model_path_back_as_it_parses(path):
    from mergekit.config import MergeConfiguration

    from mergekit_ram.commands.api import recipe_yaml

    models = [{"model": f"{path}/alpha", "parameters": {"unique_scale": 1.5}}]
    models += [{"model": f"{path}/beta+{path}/lora"}]
    config = dict(merge_method="ramplus", base_model=f"{path}/base", models=models)
    config |= dict(parameters={"r": 0.2}, dtype="bfloat16")
    config = MergeConfiguration.model_validate(config)
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
    args = [str(config), "-I", str(stages), "--quiet"]
    result = CliRunner().invoke(mergekit_multi, args)
    assert result.exit_code == 0, result.output
    ours, config = tmp_path / "ours", MergeConfiguration.model_validate(document)
    mergekit_ram.run_merge(config, os.fsencode(ours), MergeOptions(quiet=True))
    for name in ("model.safetensors", "ram_statistics.json"):
        found = list(stages.rglob(name))
        assert len(found) == 1, list(stages.rglob("*"))
    weights = next(stages.rglob("model.safetensors")).read_bytes()
    assert weights == (ours / "model.safetensors").read_bytes()
