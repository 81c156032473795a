"""Parameters the output cannot hold (issue findings 8 and 10): λ beyond the
output dtype and empty lists refused before a weight is read; λ·τ that
overflows the output dtype refused while merging, naming the tensor."""

from __future__ import annotations

import shutil

import pytest
import yaml
from click.testing import CliRunner
from rejected_inputs import no_weight_reads
from safetensors.torch import load_file, save_file

from mergekit_ram.commands.cli import main


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


def test_empty_list_is_refused(family, tmp_path):
    result, _ = run(tmp_path, family.config_dict("ramplus", parameters={"r": []}))
    assert result.exit_code == 2 and "an empty list gives r no value" in result.output
