"""Does RAM+'s λ survive the output dtype? The counting itself: rounding
checked element by element, and when a tally says the rescale was lost."""

from __future__ import annotations

import torch

from mergekit_ram.core.survival import SurvivalTally, survivors


def test_survivors_counts_rounding():
    base32 = torch.tensor([1.0, 1.0, 0.0, 1.0])
    tau = torch.tensor([0.0078125, 0.0078125, 0.01, 0.5])
    rescaled = torch.tensor([True, True, True, False])
    # bf16 around 1: λ = 1.1 moves 1.0078125 to 1.00859375, which rounds back.
    assert survivors(base32, tau, rescaled, 1.1, torch.bfloat16) == 1
    assert survivors(base32, tau, rescaled, 1.1, torch.float32) == 3
    assert survivors(base32, tau, rescaled, 1.0, torch.float32) == 0


def test_tally_warns_only_when_mostly_lost():
    tally = SurvivalTally()
    tally.add("a", 10, 6, "bfloat16")
    assert not tally.lost()
    tally.add("b", 10, 1, "bfloat16")
    assert tally.lost()
    assert "7 of 20" in tally.warning() and "bfloat16" in tally.warning()
    assert not SurvivalTally().lost()


def test_survivors_over_sparse_and_dense_chunks_equal_elementwise():
    # Chunks of every kind: empty, sparse (gathered) and dense (computed
    # whole), in a (rows, cols) tensor spanning several chunks.
    from mergekit_ram.core import survival

    generator = torch.Generator().manual_seed(3)
    size = survival._CHUNK
    density = torch.cat(
        [torch.zeros(size), torch.full((size,), 0.05), torch.full((size + 74,), 0.9)]
    )
    rescaled = (torch.rand(density.shape, generator=generator) < density).view(-1, 7)
    base32 = torch.randn(rescaled.shape, generator=generator)
    tau = torch.randn(rescaled.shape, generator=generator) * 0.01
    for dtype in (torch.bfloat16, torch.float16):
        scaled = (base32 + tau * 1.1).to(dtype)
        plain = (base32 + tau).to(dtype)
        expected = int(((scaled != plain) & rescaled).sum())
        assert 0 < expected < int(rescaled.sum())
        assert survivors(base32, tau, rescaled, 1.1, dtype) == expected
