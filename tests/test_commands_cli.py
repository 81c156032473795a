"""`mergekit-ram merge`: mergekit-yaml's options, global RAM+ (click CliRunner)."""

from __future__ import annotations

import importlib.metadata
import json

import click
import pytest
import reference
import torch
import yaml
from click.testing import CliRunner
from conftest import read_json
from mergekit.options import add_merge_options
from safetensors.torch import load_file

from mergekit_ram.commands.cli import main


def mergekit_option_names() -> list[str]:
    """Every option string mergekit's own add_merge_options defines."""

    @click.command()
    @add_merge_options
    def probe(merge_options):  # pragma: no cover - never invoked
        del merge_options

    names = []
    for param in probe.params:
        names += [*param.opts, *param.secondary_opts]
    return [n for n in names if n.startswith("-")]


def test_merge_help_lists_mergekit_options():
    result = CliRunner().invoke(main, ["merge", "--help"])
    assert result.exit_code == 0, result.output
    names = mergekit_option_names()
    assert "--cuda" in names and "--out-shard-size" in names
    missing = [n for n in names if n not in result.output]
    assert not missing, result.output
    assert "CONFIG_FILE" in result.output and "OUT_PATH" in result.output


def load_merged(out) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(str(out / "model.safetensors"))
    files = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    state = {}
    for name in files:
        state.update(load_file(str(out / name)))
    return state


@pytest.mark.parametrize("shard", [None, "8K"])
def test_merge_yaml(shard, family_f32, tmp_path):
    family = family_f32
    settings = dict(r=0.2, alpha=1.5, saturation="clip")
    config = tmp_path / "ramplus.yml"
    text = "# RAM+ of three agents\n" + family.yaml("ramplus", parameters=settings)
    config.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    args = ["merge", str(config), str(out), "--quiet"]
    if shard is not None:
        args += ["--out-shard-size", shard]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

    base = family.state("base")
    expected, lambdas = reference.merge(base, family.task_states(), **settings)
    merged = load_merged(out)
    assert sorted(merged) == sorted(expected)
    for name in expected:
        assert torch.equal(merged[name], expected[name]), name
    # mergekit's own option reached the writer: small shards, several files.
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (shard is not None)

    assert (out / "mergekit_config.yml").read_text(encoding="utf-8") == text
    doc = read_json(out / "ram_statistics.json")
    assert doc["r"] == settings["r"] and doc["alpha"] == settings["alpha"]
    scales = {row["model"]: row["scale"] for row in doc["tasks"]}
    for t, name in enumerate(family.tasks):
        assert scales[family.paths[name]] == pytest.approx(lambdas[t], rel=1e-12)


def test_merge_refuses_missing_config(tmp_path):
    result = CliRunner().invoke(
        main, ["merge", str(tmp_path / "missing.yml"), str(tmp_path / "out")]
    )
    assert result.exit_code != 0
    assert "missing.yml" in result.output
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def sanity_family(model_family):
    return model_family("sanity", seed=61)


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_analyze_epsilon_passes_the_yaml_checks(sanity_family, tmp_path, value):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(sanity_family.config_dict("ramplus")))
    result = CliRunner().invoke(main, ["analyze", str(path), "--epsilon", value])
    assert result.exit_code == 2, result.output
    assert "finite number ≥ 0" in result.output


def test_version_names_both_packages():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    ours = importlib.metadata.version("mergekit-ram")
    host = importlib.metadata.version("mergekit")
    assert result.output == f"mergekit-ram {ours}, mergekit {host}\n"
