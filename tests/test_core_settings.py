"""core.settings: the one rule for what whole-model statistics need as one value."""

from __future__ import annotations

import pytest

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.settings import MergeSettings, varying_key

ONE = {
    "epsilon": {1e-5},
    "r": {0.1},
    "alpha": {2.0},
    "saturation": {"clip"},
    "statistics": {"global"},
}


def test_one_value_everywhere_is_accepted():
    assert varying_key(ONE) is None


@pytest.mark.parametrize("key, other", [("epsilon", 1e-4), ("alpha", 1.0)])
def test_a_varying_key_is_named_under_global_statistics(key, other):
    assert varying_key({**ONE, key: ONE[key] | {other}}) == key


def test_varying_values_are_fine_without_whole_model_statistics():
    # r = 0 everywhere (RAM) or statistics: tensor: every tensor stands alone.
    assert varying_key({**ONE, "r": {0.0}, "epsilon": {1e-5, 1e-4}}) is None
    assert varying_key({**ONE, "statistics": {"tensor"}, "r": {0.1, 0.2}}) is None


def test_r_varying_between_zero_and_positive_is_refused():
    assert varying_key({**ONE, "r": {0.0, 0.1}}) == "r"


def test_from_parameters_names_two_tensors_that_disagree():
    params = {key: next(iter(values)) for key, values in ONE.items()}
    per_tensor = [("a", params), ("b", params), ("c", {**params, "alpha": 1.0})]
    with pytest.raises(
        RAMInputError, match="'alpha' is 2.0 for tensor a but 1.0 for c"
    ):
        MergeSettings.from_parameters(per_tensor)
    settings = MergeSettings.from_parameters(per_tensor[:2])
    assert settings.as_dict() == params


def test_from_parameters_needs_a_tensor():
    with pytest.raises(ValueError, match="no tensors"):
        MergeSettings.from_parameters([])
