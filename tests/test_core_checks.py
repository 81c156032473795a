"""mergekit_ram.core.checks: a merged tensor that overflowed is refused (finding 8)."""

from __future__ import annotations

import pytest
import torch

from mergekit_ram.core.checks import finite_output
from mergekit_ram.core.errors import RAMInputError


def test_finite_output_allows_nonfinite_kept_from_the_base(on_device):
    base = torch.tensor([1.0, float("inf")], device=on_device)
    finite_output("t", base, base.clone())
    merged = torch.tensor([1e6, float("inf")], device=on_device)
    with pytest.raises(RAMInputError, match="Merged tensor t has 1"):
        finite_output("t", base, merged.to(torch.float16))
