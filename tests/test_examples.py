"""Every shipped example config merges the demo's models as its comment says."""

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from safetensors.torch import load_file

import mergekit_ram
from mergekit_ram.commands.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "example_configs"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder after the documented step, `mergekit-ram demo --out .`."""
    root = tmp_path_factory.mktemp("examples")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        result = CliRunner().invoke(main, ["demo", "--out", "."])
    assert result.exit_code == 0, result.output
    return root


def merge_example(name, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    source = (EXAMPLES / name).read_text()
    config = MergeConfiguration.model_validate(yaml.safe_load(source))
    out = workdir / f"out-{name}"
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True), source)
    assert (out / "config.json").exists()
    assert (out / "mergekit_config.yml").read_text() == source
    stats = out / "ram_statistics.json"
    return json.loads(stats.read_text()) if stats.exists() else None


def test_examples_cover_the_documented_modes():
    names = sorted(p.name for p in EXAMPLES.glob("*.yml"))
    assert names == [
        "ram.yml",
        "ram_ties.yml",
        "ram_unique.yml",
        "ramplus.yml",
        "ramplus_arm_r_v2.yml",
        "ramplus_explicit_scale.yml",
        "ramplus_tensor_local.yml",
    ]


NO_PASS = "ram ram_ties ram_unique ramplus_tensor_local ramplus_explicit_scale"


@pytest.mark.parametrize("name", [f"{name}.yml" for name in NO_PASS.split()])
def test_examples_without_whole_model_statistics_run_no_pass(
    name, workdir, monkeypatch
):
    assert merge_example(name, workdir, monkeypatch) is None


@pytest.mark.parametrize(
    "name, r, cap", [("ramplus.yml", 0.1, 2.0), ("ramplus_arm_r_v2.yml", 0.2, 1.0)]
)
def test_global_examples_use_their_rule(name, r, cap, workdir, monkeypatch):
    document = merge_example(name, workdir, monkeypatch)
    assert (document["r"], document["alpha"], document["saturation"]) == (
        r,
        cap,
        "clip",
    )
    for task in document["tasks"]:
        rho = task["shared"] / task["unique"]
        assert task["scale"] == pytest.approx(1 + r * min(rho, cap), rel=1e-12)


def test_explicit_scales_are_the_global_merges_exactly(workdir, monkeypatch):
    """The scales written in the example are ramplus.yml's, copied exactly, so
    the explicit merge writes the same weights without a statistics pass."""
    computed = merge_example("ramplus.yml", workdir, monkeypatch)
    merge_example("ramplus_explicit_scale.yml", workdir, monkeypatch)
    example = yaml.safe_load((EXAMPLES / "ramplus_explicit_scale.yml").read_text())
    written = [m["parameters"]["unique_scale"] for m in example["models"]]
    assert written == [task["scale"] for task in computed["tasks"]]
    global_ = load_file(workdir / "out-ramplus.yml" / "model.safetensors")
    explicit = load_file(
        workdir / "out-ramplus_explicit_scale.yml" / "model.safetensors"
    )
    assert global_.keys() == explicit.keys()
    for name, tensor in global_.items():
        assert explicit[name].dtype == tensor.dtype, name
        assert explicit[name].equal(tensor), name
