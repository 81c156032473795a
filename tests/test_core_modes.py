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


def expected(base, tasks, *, density=0.1, scales=None, shared="ties"):
    options = dict(shared=shared, density=density, unique_scale=scales)
    return reference.merge(*as_dicts(base, tasks), **options)[0]["w"]


@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_edge_case_equals_reference(density):
    base, tasks = edge_case()
    options = dict(epsilon=EPSILON, scales=[1.0] * 3, density=density)
    got = ties_merge_tensor(base, tasks, **options)
    assert torch.equal(got, expected(base, tasks, density=density))
    if density == 1.0:  # nothing trimmed: element 0's masses tie, no sign
        assert got[0] == base[0]
    if density == 0.1:
        # The rules, by hand: n = 5 shared, k = int(0.9·5) = 4. Task 1
        # keeps |v| ≥ 4th smallest of (0.5, 0.01, 0.9, 0.8, 0.5) = 0.8: 0.9
        # and 0.8; task 2 keeps ≥ 0.7: 0.7, 0.75 (the -0.75); task 3 keeps ≥
        # 0.25 of (0.25, 0, 0, 0.4, 0): both.
        by_hand = [-0.25, 0.0, 0.8, 0.6, -0.75, 0.3, 0.0, 0.0]
        assert got.tolist() == pytest.approx(by_hand, abs=1e-7)


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


THEIRS = [0.0, 1 / 3, 0.0]  # shared: base, their target_index 1 at their factor 1/3
TYPES = (torch.float32, torch.bfloat16, torch.float16)
CHOSEN = ([0.0, 1.0, 0.0], THEIRS, [1.0, 1.0, 1.0])  # shared: base's scales
# (shared, dtype, scales, density)
RANDOM = [("ties", t, [1.25, 1.0, 1.1], d) for t in TYPES for d in (0.1, 0.3)]
RANDOM += [("base", t, s, 0.1) for t in TYPES[:2] for s in CHOSEN]
SHAPE_SEED = {"ties": ((64, 48), 7), "base": ((48, 40), 11)}


@pytest.mark.parametrize("shared, dtype, scales, density", RANDOM)
def test_random_tensors_equal_reference(shared, dtype, scales, density, on_device):
    shape, seed = SHAPE_SEED[shared]
    base, tasks = sparse_tasks(shape, [0.2, 0.35, 0.5], seed=seed)
    assert_all_classes(base, tasks)
    base, tasks = cast(base, tasks, dtype)
    merge = ties_merge_tensor if shared == "ties" else unique_merge_tensor
    extra = {"density": density} if shared == "ties" else {}
    got = merge(*on(on_device, base, tasks), epsilon=EPSILON, scales=scales, **extra)
    assert got.device.type == on_device and got.dtype == dtype
    want = expected(base, tasks, density=density, scales=scales, shared=shared)
    assert torch.equal(got.cpu(), want)
    if shared == "ties":  # TIES changed the shared elements: it is not RAM.
        mean = expected(base, tasks, scales=scales, shared="mean")
        assert not torch.equal(got.cpu(), mean)


def test_base_mode_moves_only_the_chosen_tasks_unique_elements_move():
    rows = [[0.3, 0.2, 0, 0, 5e-6, 0], [0, 0.4, 0.6, 0, 0, 0], [0, 0, 0, 0.9, 0, 0]]
    tasks = [torch.tensor(row) for row in rows]
    got = unique_merge_tensor(torch.zeros(6), tasks, epsilon=EPSILON, scales=THEIRS)
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
        explicit = {n: {"unique_scale": v} for n, v in chosen.items()}
        types = dict(dtype="float32", out_dtype="bfloat16")
        types |= dict(model_parameters=explicit)
        text = family.yaml("ram", {"shared": "base"}, **types)
        written = torch.bfloat16
        settings = dict(shared="base", unique_scale=list(chosen.values()))
        settings["out_dtype"] = written
        base = {k: v.float() for k, v in family.state("base").items()}
        tasks = [{k: v.float() for k, v in t.items()} for t in family.task_states()]
    merged = merge_yaml(text, tmp_path / "out")
    want, _ = reference.merge(base, tasks, **settings)
    assert sorted(merged) == sorted(want)
    for name in want:
        assert merged[name].dtype == written and torch.equal(merged[name], want[name])
    assert (tmp_path / "out" / "ram_statistics.json").exists() == (shared == "ties")
