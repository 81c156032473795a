"""Does RAM+'s λ survive the output dtype? The kernel's count (`on_rescaled`)
against the dense reference element by element, and when a tally says the
rescale was lost."""

from __future__ import annotations

import pytest
import reference
import torch
from tensors import EPSILON, as_dicts, cast, on, sparse_tasks

from mergekit_ram.core import kernel
from mergekit_ram.core.kernel import ram_merge_tensor
from mergekit_ram.core.survival import SurvivalTally

SCALES = [1.002, 1.0, 1.3]  # lost in bf16 on most elements / none / kept on most


def reference_survival(base, tasks, scales, written):
    """Per task: (unique elements, of which RAM+ and RAM are written apart)."""
    plus, _ = reference.merge(*as_dicts(base, tasks), unique_scale=scales,
                              out_dtype=written)  # fmt: skip
    ram, _ = reference.merge(*as_dicts(base, tasks), out_dtype=written)
    _tau, m, c = reference.counts(*as_dicts(base, tasks), EPSILON)["w"]
    found = []
    for t in range(len(tasks)):
        unique = m[t] & (c == 1)
        found.append((int(unique.sum()), int((plus["w"] != ram["w"])[unique].sum())))
    return found


def kernel_survival(base, tasks, scales, written):
    heard = {}
    out = ram_merge_tensor(
        base,
        tasks,
        epsilon=EPSILON,
        scales=scales,
        out_dtype=written,
        on_rescaled=lambda index, rescaled, survived: heard.update(
            {index: (rescaled, survived)}
        ),
    )
    return out, heard


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
    want = reference_survival(base, tasks, SCALES, written)
    assert heard == {0: want[0], 2: want[2]}
    assert all(rescaled > 0 for rescaled, _ in heard.values())
    if written == torch.float32:
        assert all(survived == rescaled for rescaled, survived in heard.values())
    else:
        # bf16 / fp16 lose λ = 1.002 on some elements: the count can tell.
        assert heard[0][1] < heard[0][0]
    plus, _ = reference.merge(*as_dicts(base, tasks), unique_scale=SCALES,
                              out_dtype=written)  # fmt: skip
    assert out.device.type == on_device
    assert torch.equal(out.cpu(), plus["w"])


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
