"""Output sanity and CLI numbers (issue findings 8 and 10)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner
from rejected_inputs import no_weight_reads
from safetensors.torch import load_file, save_file

from mergekit_ram.cli import main
from mergekit_ram.errors import RAMInputError
from mergekit_ram.inputs import finite_output
from mergekit_ram.report import strict_json


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("sanity", seed=61)


def run(tmp_path, config: dict, *args: str, before_weights: bool = True):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    command = ["merge", str(path), str(out), "--quiet", *args]
    if before_weights:
        with no_weight_reads():
            return CliRunner().invoke(main, command), out
    return CliRunner().invoke(main, command), out


@pytest.mark.parametrize(
    "parameters, model_parameters, dtype, fragment",
    [
        ({"r": 1e308}, None, None, "r = 1e+308"),
        (None, {"alpha": {"unique_scale": 1e39}}, None, "unique_scale = 1e+39"),
        ({"r": 1e5}, None, "float16", "largest float16 value"),
    ],
)
def test_lambda_beyond_the_output_dtype_is_refused_before_weights(
    family, tmp_path, parameters, model_parameters, dtype, fragment
):
    config = family.config_dict(
        "ramplus", parameters=parameters, model_parameters=model_parameters
    )
    if dtype:
        config["out_dtype"] = dtype
    result, out = run(tmp_path, config)
    assert result.exit_code == 2, result.output
    assert fragment in result.output and "±Inf" in result.output
    assert not out.exists()


def test_overflow_in_the_output_dtype_is_refused_naming_the_tensor(family, tmp_path):
    # λ fits float16, λ·τ does not: found while merging, nothing published.
    task = tmp_path / "alpha"
    shutil.copytree(family.paths["alpha"], task)
    state = load_file(str(task / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.weight"].view(-1)[5] += 10.0
    save_file(state, str(task / "model.safetensors"), metadata={"format": "pt"})
    config = family.config_dict(
        "ramplus",
        tasks=["alpha"],
        model_parameters={"alpha": {"unique_scale": 60000.0}},
    )
    config["models"][0]["model"] = str(task)
    config["out_dtype"] = "float16"
    result, out = run(tmp_path, config, before_weights=False)
    assert result.exit_code == 2, result.output
    assert "Merged tensor model.layers.1.mlp.up_proj.weight has 1" in result.output
    assert "torch.float16" in result.output and "unique_scale" in result.output
    assert not out.exists()


def test_finite_output_allows_nonfinite_kept_from_the_base():
    base = torch.tensor([1.0, float("inf")])
    finite_output("t", base, base.clone())
    with pytest.raises(RAMInputError, match="Merged tensor t has 1"):
        finite_output("t", base, torch.tensor([1e6, float("inf")]), torch.float16)


def test_empty_list_is_refused(family, tmp_path):
    result, _ = run(tmp_path, family.config_dict("ramplus", parameters={"r": []}))
    assert result.exit_code == 2 and "an empty list gives r no value" in result.output


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_analyze_epsilon_passes_the_yaml_checks(family, tmp_path, value):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(family.config_dict("ramplus")))
    result = CliRunner().invoke(main, ["analyze", str(path), "--epsilon", value])
    assert result.exit_code == 2, result.output
    assert "finite number ≥ 0" in result.output


def test_report_json_is_strict():
    document = {"a": [float("inf"), 1.5], "b": {"c": float("nan")}, "d": "x"}
    text = json.dumps(strict_json(document), allow_nan=False)
    assert json.loads(text) == {"a": [None, 1.5], "b": {"c": None}, "d": "x"}
    assert math.isfinite(strict_json(2.0))
