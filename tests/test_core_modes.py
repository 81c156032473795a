"""shared: ties and shared: base (the authors' arm-ties and arm-unique, the
paper's Fig. 3) against the dense reference."""

from __future__ import annotations

from functools import partial

import pytest
import reference
import torch
from conftest import merge_yaml
from tensors import EPSILON, as_dicts, assert_all_classes, cast, on, sparse_tasks

from mergekit_ram.core.kernel import change_mask, overlap_counts, task_vector
from mergekit_ram.core.modes import _trimmed, ties_merge_tensor, unique_merge_tensor


def edge_case() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Base 0 and three tasks whose shared region holds every TIES edge:

    0: +0.5 against −0.25 − 0.25, a tie when nothing is trimmed (density 1)
       → no sign, the base;
    1: +0.5 / −0.5, both trimmed away with the default density → zero mass;
    2-3: agreeing large values; 4: −0.75 outweighs +0.5 (kept: only −0.75);
    5: unique, 6: unchanged, 7: shared but only by sub-threshold noise.
    """
    base = torch.zeros(8)
    t1 = torch.tensor([0.5, 0.01, 0.9, 0.8, 0.5, 0.3, 0.0, 5e-6])
    t2 = torch.tensor([-0.25, -0.01, 0.7, 0.6, -0.75, 0.0, 0.0, 5e-6])
    t3 = torch.tensor([-0.25, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0])
    return base, [t1, t2, t3]


def expected(base, tasks, *, density=0.1, scales=None, out_dtype=None):
    b, ts = as_dicts(base, tasks)
    merged, _ = reference.merge(
        b, ts, shared="ties", density=density, unique_scale=scales, out_dtype=out_dtype
    )
    return merged["w"]


@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_edge_case_equals_reference(density):
    base, tasks = edge_case()
    got = ties_merge_tensor(
        base, tasks, epsilon=EPSILON, scales=[1.0] * 3, density=density
    )
    assert torch.equal(got, expected(base, tasks, density=density))
    if density == 1.0:  # nothing trimmed: element 0's masses tie, no sign
        assert got[0] == base[0]


def test_edge_case_values():
    """The issue's rules, by hand: n = 5 shared, k = int(0.9·5) = 4."""
    base, tasks = edge_case()
    got = ties_merge_tensor(base, tasks, epsilon=EPSILON, scales=[1.0] * 3, density=0.1)
    # Task 1 keeps |v| ≥ 4th smallest of (0.5, 0.01, 0.9, 0.8, 0.5) = 0.8:
    # 0.9 and 0.8; task 2 keeps ≥ 0.7: 0.7, 0.75 (the -0.75); task 3 keeps ≥
    # 0.25 of (0.25, 0, 0, 0.4, 0): both.
    assert got.tolist() == pytest.approx(
        [-0.25, 0.0, 0.8, 0.6, -0.75, 0.3, 0.0, 0.0], abs=1e-7
    )


def test_one_shared_element_is_not_trimmed():
    """n = 1 → k = 0: nothing trimmed, the agreeing values are averaged."""
    base = torch.zeros(4)
    tasks = [torch.tensor([0.2, 0.1, 0, 0]), torch.tensor([0.4, 0, 0.3, 0])]
    got = ties_merge_tensor(base, tasks, epsilon=EPSILON, scales=[1.0, 1.0], density=0)
    assert got.tolist() == pytest.approx([0.3, 0.1, 0.3, 0.0])
    assert torch.equal(got, expected(base, tasks, density=0.0))


@pytest.mark.parametrize(
    "merge", [partial(ties_merge_tensor, density=0), unique_merge_tensor]
)
def test_no_shared_element_is_ram(merge):
    base = torch.zeros(4)
    tasks = [torch.tensor([0.2, 0, 0, 0]), torch.tensor([0, 0, 0.3, 0])]
    got = merge(base, tasks, epsilon=EPSILON, scales=[1.5, 0.0])
    assert got.tolist() == pytest.approx([0.3, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("density", [0.0, 0.1, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trimming_always_keeps_a_value(density, seed):
    """Why there is no all-trimmed fallback: each task changing a shared
    element keeps its largest magnitude there."""
    base, tasks = sparse_tasks((40, 30), [0.3, 0.4, 0.5], seed=seed)
    counts = overlap_counts(base, tasks, EPSILON)
    shared = counts >= 2
    k = int((1 - density) * int(shared.sum()))
    for task in tasks:
        tau = task_vector(task, base)[shared]
        values = torch.where(change_mask(tau, EPSILON), tau, 0.0)
        if values.abs().max() > 0:
            kept = _trimmed(values, k)
            assert kept.abs().max() == values.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("density", [0.1, 0.3])
def test_random_tensors_equal_reference(dtype, density, on_device):
    base, tasks = sparse_tasks((64, 48), [0.2, 0.35, 0.5], seed=7)
    assert_all_classes(base, tasks)
    base, tasks = cast(base, tasks, dtype)
    scales = [1.25, 1.0, 1.1]
    got = ties_merge_tensor(
        *on(on_device, base, tasks), epsilon=EPSILON, scales=scales, density=density
    )
    assert got.device.type == on_device
    got = got.cpu()
    want = expected(base, tasks, density=density, scales=scales)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    # TIES changed the shared elements: it is not RAM.
    b, ts = as_dicts(base, tasks)
    ram, _ = reference.merge(b, ts, unique_scale=scales)
    assert not torch.equal(got, ram["w"])


# --- shared: base -----------------------------------------------------------

THEIRS = [0.0, 1 / 3, 0.0]  # their target_index 1 at their fixed factor 1/3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [[0.0, 1.0, 0.0], THEIRS, [1.0, 1.0, 1.0]])
def test_base_mode_equals_reference(dtype, scales, on_device):
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


def test_base_mode_moves_only_the_chosen_tasks_unique_elements_move():
    base = torch.zeros(6)
    tasks = [
        torch.tensor([0.3, 0.2, 0.0, 0.0, 5e-6, 0.0]),
        torch.tensor([0.0, 0.4, 0.6, 0.0, 0.0, 0.0]),
        torch.tensor([0.0, 0.0, 0.0, 0.9, 0.0, 0.0]),
    ]
    got = unique_merge_tensor(base, tasks, epsilon=EPSILON, scales=THEIRS)
    # Only element 2 is task 1's alone; element 1 is shared (base).
    assert got.tolist() == pytest.approx([0, 0, 0.2, 0, 0, 0])


@pytest.mark.parametrize("shared", ["ties", "base"])
def test_yaml_merge_equals_reference(shared, family_bf16, tmp_path):
    """Through mergekit's planner: ramplus with shared: ties (global λ on the
    unique elements, TIES on the shared ones, written in float32), and ram
    with shared: base keeping one model's unique changes (Fig. 3)."""
    family = family_bf16
    if shared == "ties":
        settings = {"r": 0.3, "alpha": 1.0, "shared": "ties", "density": 0.2}
        text = family.yaml("ramplus", parameters=settings, out_dtype="float32")
        settings["out_dtype"] = written = torch.float32
        base, tasks = family.state("base"), family.task_states()
    else:
        chosen = {n: float(n == family.tasks[1]) for n in family.tasks}
        text = family.yaml(
            "ram",
            parameters={"shared": "base"},
            model_parameters={n: {"unique_scale": v} for n, v in chosen.items()},
            dtype="float32",
            out_dtype="bfloat16",
        )
        written = torch.bfloat16
        settings = {"shared": "base", "unique_scale": list(chosen.values())}
        settings["out_dtype"] = written
        base = {k: v.float() for k, v in family.state("base").items()}
        tasks = [{k: v.float() for k, v in t.items()} for t in family.task_states()]
    out = tmp_path / "out"
    merged = merge_yaml(text, out)
    want, _ = reference.merge(base, tasks, **settings)
    assert sorted(merged) == sorted(want)
    for name in want:
        assert merged[name].dtype == written
        assert torch.equal(merged[name], want[name]), name
    assert (out / "ram_statistics.json").exists() == (shared == "ties")
