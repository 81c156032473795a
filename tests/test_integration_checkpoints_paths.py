"""Paths by identity (issue findings 6 and 7), refused before a weight is read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from rejected_inputs import no_weight_reads

import mergekit_ram
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import first_duplicate, output_conflict


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("paths", seed=41)


def merge(config: dict, out: Path) -> None:
    with no_weight_reads():
        mergekit_ram.run_merge(
            MergeConfiguration.model_validate(config),
            str(out),
            MergeOptions(quiet=True),
        )


def test_out_that_is_the_tokenizer_source_is_refused(family, tmp_path):
    source = tmp_path / "tok"
    shutil.copytree(family.paths["alpha"], source)
    before = sorted(os.listdir(source))
    config = family.config_dict("ram", tokenizer_source=str(source))
    with pytest.raises(RAMInputError, match="is the input tokenizer_source"):
        merge(config, source)
    assert sorted(os.listdir(source)) == before


def test_out_inside_an_input_is_refused(family, tmp_path):
    with pytest.raises(RAMInputError, match="lies inside the input model"):
        merge(family.config_dict("ram"), Path(family.paths["beta"]) / "merged")
    assert not (Path(family.paths["beta"]) / "merged").exists()


def test_input_file_linked_into_out_is_refused(family, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(Path(family.paths["gamma"]) / "model.safetensors", out)
    (out / "mergekit_config.yml").write_text("a previous merge")
    linked = tmp_path / "gamma"
    shutil.copytree(family.paths["gamma"], linked)
    (linked / "model.safetensors").unlink()
    os.symlink(out / "model.safetensors", linked / "model.safetensors")
    config = family.config_dict("ram")
    config["models"][-1]["model"] = str(linked)
    with pytest.raises(RAMInputError, match="resolves to .* inside the output folder"):
        merge(config, out)
    assert (linked / "model.safetensors").resolve().is_file()


@pytest.mark.parametrize("spelling", ["./{rel}", "{abs}", "./{rel}/../{name}"])
def test_same_model_under_two_spellings_is_refused(family, spelling, monkeypatch):
    root = Path(family.paths["alpha"]).parent
    monkeypatch.chdir(root.parent)
    name = "alpha"
    rel = f"{root.name}/{name}"
    config = family.config_dict("ram")
    config["models"].append(
        {"model": spelling.format(rel=rel, abs=family.paths[name], name=name)}
    )
    if spelling == "{abs}":  # literally the same string: the older message
        match = "already listed"
    else:
        match = "same folder as"
    with pytest.raises(RAMInputError, match=match):
        merge(config, root.parent / "out-dup")


def test_base_under_another_spelling_is_refused(family, tmp_path):
    link = tmp_path / "base-link"
    os.symlink(family.paths["base"], link)
    config = family.config_dict("ram")
    config["models"].append({"model": str(link)})
    with pytest.raises(RAMInputError, match="same folder as base_model"):
        merge(config, tmp_path / "out")


def test_first_duplicate_and_output_conflict(tmp_path):
    (tmp_path / "a").mkdir()
    assert first_duplicate([("x", str(tmp_path / "a")), ("y", "org/model")]) is None
    found = first_duplicate([("x", str(tmp_path / "a")), ("y", f"{tmp_path}/a/../a")])
    assert found is not None and found[1][0] == "y"
    assert (
        output_conflict(str(tmp_path / "b"), [("model", str(tmp_path / "a"))]) is None
    )
    assert "is the input" in output_conflict(
        f"{tmp_path}/a/.", [("model", str(tmp_path / "a"))]
    )


def test_a_shard_the_index_names_inside_out_is_refused(family, tmp_path):
    """Issue 17 item 3: the index of a task model names a shard inside OUT."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mergekit_config.yml").write_text("a previous merge")
    shutil.copy(Path(family.paths["gamma"]) / "model.safetensors", out / "shard.st")
    task = tmp_path / "gamma"
    shutil.copytree(family.paths["gamma"], task)
    (task / "model.safetensors").unlink()
    from safetensors import safe_open

    with safe_open(str(out / "shard.st"), "pt") as handle:
        names = list(handle.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "../out/shard.st")}
    (task / "model.safetensors.index.json").write_text(json.dumps(index))
    config = family.config_dict("ram")
    config["models"][-1]["model"] = str(task)
    with pytest.raises(RAMInputError, match="reads ../out/shard.st"):
        merge(config, out)
    assert (out / "shard.st").is_file()


def test_an_input_inside_out_is_refused(family, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(family.paths["gamma"], out / "gamma")
    config = family.config_dict("ram")
    config["models"][-1]["model"] = str(out / "gamma")
    with pytest.raises(RAMInputError, match="lies inside the output folder"):
        merge(config, out)
