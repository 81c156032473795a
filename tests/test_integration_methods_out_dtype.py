"""out_dtype and dtype decide what is written: the float32 result rounded once."""

from __future__ import annotations

import pytest
import reference
import torch
from conftest import merge_yaml
from tensors import as_dicts, assert_all_classes, cast, on, sparse_tasks

from mergekit_ram.commands.api import merge_tensors

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_smallest_case_of_the_issue():
    """Two 2-element bf16 agents, each changing one element, λ = 1.5."""
    rows = [[1.0, 0.5], [1.0078125, 0.5], [1.0, 0.50390625]]
    tensors = [torch.tensor(row, dtype=torch.bfloat16) for row in rows]
    kwargs = dict(parameters={"unique_scale": 1.5}, base_index=0)
    for options, dtype, values in (
        (dict(out_dtype=torch.float32), torch.float32, [1.01171875, 0.505859375]),
        (dict(dtype=torch.float32), torch.float32, [1.01171875, 0.505859375]),
        ({}, torch.bfloat16, [1.015625, 0.5078125]),
    ):
        written = merge_tensors(tensors, "ramplus", **kwargs, **options)
        assert written.dtype == dtype and written.tolist() == values


@pytest.mark.parametrize("shared", ["mean", "ties", "base"])
@pytest.mark.parametrize("out_dtype", [None, *DTYPES])
@pytest.mark.parametrize("dtype", [None, *DTYPES])
@pytest.mark.parametrize("stored", DTYPES)
def test_every_combination_equals_reference(
    stored, dtype, out_dtype, shared, on_device
):
    base, tasks = sparse_tasks((24, 20), [0.2, 0.35, 0.5], seed=5)
    assert_all_classes(base, tasks)
    base, tasks = cast(base, tasks, stored)
    settings = dict(unique_scale=[1.3, 1.1, 1.0], shared=shared)
    on_base, on_tasks = on(on_device, base, tasks)
    kwargs = dict(parameters=settings, base_index=0, dtype=dtype, out_dtype=out_dtype)
    got = merge_tensors([on_base, *on_tasks], "ramplus", **kwargs)
    # mergekit's convention: dtype sets what the method computes from (and
    # writes without out_dtype); out_dtype sets what is written.
    computed, written = dtype or stored, out_dtype or dtype or stored
    inputs = as_dicts(*cast(base, tasks, computed))
    want, _ = reference.merge(*inputs, **settings, out_dtype=written)
    assert got.dtype == written and got.device.type == on_device
    assert torch.equal(got.cpu(), want["w"])


@pytest.mark.parametrize("out_dtype", ["float32", "float16"])
def test_yaml_out_dtype_writes_the_float32_result_rounded_once(
    out_dtype, family_bf16, tmp_path
):
    family, written = family_bf16, getattr(torch, out_dtype)
    text = family.yaml("ramplus", parameters={"r": 0.3}, out_dtype=out_dtype)
    merged = merge_yaml(text, tmp_path / "out")
    inputs = family.state("base"), family.task_states()
    want, _ = reference.merge(*inputs, r=0.3, out_dtype=written)
    bf16, _ = reference.merge(*inputs, r=0.3)
    differs = 0
    for name in want:
        assert merged[name].dtype == written and torch.equal(merged[name], want[name])
        differs += int((bf16[name].to(written) != want[name]).sum())
    assert differs > 0  # the bug this replaces: bf16-rounded values, upcast
