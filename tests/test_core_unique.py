"""shared: base (the authors' arm-unique, paper Fig. 3) against the dense reference."""

from __future__ import annotations

import pytest
import reference
import torch
from conftest import merge_yaml
from tensors import EPSILON, as_dicts, assert_all_classes, cast, on, sparse_tasks

from mergekit_ram.core.unique import unique_merge_tensor

THEIRS = [0.0, 1 / 3, 0.0]  # their target_index 1 at their fixed factor 1/3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [[0.0, 1.0, 0.0], THEIRS, [1.0, 1.0, 1.0]])
def test_equals_reference(dtype, scales, on_device):
    base, tasks = sparse_tasks((48, 40), [0.2, 0.35, 0.5], seed=11)
    assert_all_classes(base, tasks)
    base, tasks = cast(base, tasks, dtype)
    got = unique_merge_tensor(
        *on(on_device, base, tasks), epsilon=EPSILON, scales=scales
    )
    assert got.device.type == on_device
    got = got.cpu()
    b, ts = as_dicts(base, tasks)
    want, _ = reference.merge(b, ts, shared="base", unique_scale=scales)
    assert got.dtype == dtype
    assert torch.equal(got, want["w"])


def test_only_the_chosen_tasks_unique_elements_move():
    base = torch.zeros(6)
    tasks = [
        torch.tensor([0.3, 0.2, 0.0, 0.0, 5e-6, 0.0]),
        torch.tensor([0.0, 0.4, 0.6, 0.0, 0.0, 0.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.9, 0.0, 0.0]),
    ]
    got = unique_merge_tensor(base, tasks, epsilon=EPSILON, scales=THEIRS)
    # Only element 2 is task 1's alone; element 1 is shared (base).
    assert got.tolist() == pytest.approx([0, 0, 0.2, 0, 0, 0])


def test_no_shared_element_is_ram_with_those_scales():
    base = torch.zeros(3)
    tasks = [torch.tensor([0.3, 0.0, 0.0]), torch.tensor([0.0, 0.5, 0.0])]
    got = unique_merge_tensor(base, tasks, epsilon=EPSILON, scales=[2.0, 0.0])
    assert got.tolist() == pytest.approx([0.6, 0.0, 0.0])


def test_yaml_merge_equals_reference(family_bf16, tmp_path):
    family = family_bf16
    chosen = family.tasks[1]
    scales = {name: (1.0 if name == chosen else 0.0) for name in family.tasks}
    text = family.yaml(
        "ram",
        parameters={"shared": "base"},
        model_parameters={n: {"unique_scale": v} for n, v in scales.items()},
        dtype="float32",
        out_dtype="bfloat16",
    )
    out = tmp_path / "out"
    merged = merge_yaml(text, out)
    base = {k: v.float() for k, v in family.state("base").items()}
    tasks = [{k: v.float() for k, v in t.items()} for t in family.task_states()]
    want, _ = reference.merge(
        base,
        tasks,
        shared="base",
        unique_scale=[scales[n] for n in family.tasks],
        out_dtype=torch.bfloat16,
    )
    assert sorted(merged) == sorted(want)
    moved = 0
    for name in want:
        assert torch.equal(merged[name], want[name]), name
        moved += int((merged[name] != family.state("base")[name]).sum())
    assert moved > 0
    assert not (out / "ram_statistics.json").exists()
