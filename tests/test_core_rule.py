"""core.rule: the RAM+ λ formulas against the spec's, the one-value rule of
whole-model statistics, and whether λ survives the output dtype (the
kernel's count against the dense reference, element by element)."""

from __future__ import annotations

import itertools

import pytest
import reference
import torch
from tensors import EPSILON, as_dicts, cast, on, sparse_tasks

from mergekit_ram.core import kernel
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.kernel import ram_merge_tensor
from mergekit_ram.core.rule import MergeSettings, ScaleRule, SurvivalTally

COUNTS = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1), (1, 2), (5, 2), (3, 7), (1000, 1)]
RULES = [
    ScaleRule(r=r, alpha=alpha, saturation=saturation)
    for r, alpha, saturation in itertools.product(
        [0.0, 0.1, 0.5, 3.0], [0.0, 0.5, 1.0, 2.0, 10.0], ["clip", "soft"]
    )
]


@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_scale_matches_reference(rule):
    """1 for nothing changed, no shared or r = 0; the limit without unique
    (bounds and monotony: test_core_kernel_properties)."""
    for shared, unique in COUNTS:
        got = rule.scale(shared, unique)
        expected = reference.lam(
            shared + unique, shared, unique, rule.r, rule.alpha, rule.saturation
        )
        assert got == pytest.approx(expected, rel=1e-14, abs=1e-15)
    assert rule.scale(0, 0) == rule.scale(0, 5) == 1.0
    assert rule.scale(7, 0) == rule.limit()


PARAMS = dict(epsilon=1e-5, r=0.1, alpha=2.0, saturation="clip", statistics="global")


@pytest.mark.parametrize(
    "first, second, refused",
    [
        ({}, {"alpha": 1.0}, "'alpha' is 2.0 for tensor a but 1.0 for b"),
        ({}, {"epsilon": 1e-4}, "'epsilon' is 1e-05 for tensor a but 0.0001"),
        ({"r": 0.0}, {}, "'r' is 0.0 for tensor a but 0.1 for b"),
        # r = 0 everywhere (RAM) or statistics: tensor: every tensor stands alone.
        ({"r": 0.0}, {"r": 0.0, "epsilon": 1e-4}, None),
        ({"statistics": "tensor"}, {"statistics": "tensor", "r": 0.2}, None),
    ],
)
def test_global_statistics_need_one_value_per_merge(first, second, refused):
    per_tensor = [("a", PARAMS | first), ("b", PARAMS | second), ("c", PARAMS | first)]
    if refused:
        with pytest.raises(RAMInputError, match=refused):
            MergeSettings.from_parameters(per_tensor)
    else:
        settings = MergeSettings.from_parameters(per_tensor)
        assert settings.as_dict() == PARAMS | first
    with pytest.raises(ValueError, match="no tensors"):
        MergeSettings.from_parameters([])


SCALES = [1.002, 1.0, 1.3]  # lost in bf16 on most elements / none / kept on most


def reference_survival(base, tasks, scales, written):
    """The RAM+ merge, and per task: (unique elements, of which RAM+ and RAM
    are written apart)."""
    states = as_dicts(base, tasks)
    plus, _ = reference.merge(*states, unique_scale=scales, out_dtype=written)
    ram, _ = reference.merge(*states, out_dtype=written)
    _tau, m, c = reference.counts(*states, EPSILON)["w"]
    apart = plus["w"] != ram["w"]
    unique = [m[t] & (c == 1) for t in range(len(tasks))]
    return plus["w"], [(int(u.sum()), int(apart[u].sum())) for u in unique]


def kernel_survival(base, tasks, scales, written):
    heard = {}

    def note(index, *counts):
        heard[index] = counts

    kwargs = dict(epsilon=EPSILON, scales=scales, out_dtype=written, on_rescaled=note)
    return ram_merge_tensor(base, tasks, **kwargs), heard


@pytest.mark.parametrize("written", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [7, 1 << 16])
@pytest.mark.parametrize("workers", [1, 3])
def test_kernel_counts_what_survives_elementwise(
    monkeypatch, written, chunk, workers, on_device
):
    # Chunks that end inside rows and a last partial chunk, on one or three
    # workers; every task with λ ≠ 1 is heard once, with the reference's counts.
    monkeypatch.setattr(kernel, "MERGE_CHUNK", chunk)
    threads = torch.get_num_threads()
    torch.set_num_threads(workers)
    try:
        base, tasks = cast(
            *sparse_tasks((37, 29), [0.4, 0.3, 0.5], seed=4), torch.bfloat16
        )
        out, heard = kernel_survival(*on(on_device, base, tasks), SCALES, written)
    finally:
        torch.set_num_threads(threads)
    plus, want = reference_survival(base, tasks, SCALES, written)
    assert heard == {0: want[0], 2: want[2]}
    assert all(rescaled > 0 for rescaled, _ in heard.values())
    if written == torch.float32:
        assert all(survived == rescaled for rescaled, survived in heard.values())
    else:
        # bf16 / fp16 lose λ = 1.002 on some elements: the count can tell.
        assert heard[0][1] < heard[0][0]
    assert out.device.type == on_device
    assert torch.equal(out.cpu(), plus)


def test_no_count_without_a_listener_or_a_rescale():
    base, tasks = sparse_tasks((9, 8), [0.4, 0.3], seed=1)
    _, heard = kernel_survival(base, tasks, [1.0, 1.0], torch.bfloat16)
    assert heard == {}


def test_tally_warns_only_when_mostly_lost():
    tally = SurvivalTally()
    tally.add("a", 10, 6, "bfloat16")
    assert not tally.lost()
    tally.add("b", 10, 1, "bfloat16")
    assert tally.lost()
    assert "7 of 20" in tally.warning() and "bfloat16" in tally.warning()
    assert not SurvivalTally().lost()
