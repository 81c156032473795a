"""Headers before weights (issue finding 9): every input's checkpoint files are
checked from their headers, and problems are one Error paragraph, no traceback."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from rejected_inputs import no_weight_reads
from safetensors.torch import load_file, save_file

from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.headers import model_tensors, safetensors_header


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("headers", seed=51)


def copy_task(family, tmp_path: Path, name: str = "beta") -> Path:
    path = tmp_path / f"{name}-copy"
    shutil.copytree(family.paths[name], path)
    return path


def refused(family, tmp_path: Path, task: Path) -> str:
    """Merge with `task` in place of beta; the printed Error (weights unread)."""
    config = family.config_dict("ramplus")
    for entry in config["models"]:
        if entry["model"] == family.paths["beta"]:
            entry["model"] = str(task)
    path = tmp_path / "ramplus.yml"
    path.write_text(yaml.safe_dump(config))
    with no_weight_reads():
        result = CliRunner().invoke(
            main, ["merge", str(path), str(tmp_path / "out"), "--quiet"]
        )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.startswith("Error: ")
    assert str(task) in result.output
    assert not (tmp_path / "out").exists()
    return result.output


def test_truncated_file_names_model_file_and_tensor(family, tmp_path):
    task = copy_task(family, tmp_path)
    weights = task / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    message = refused(family, tmp_path, task)
    assert "model.safetensors is truncated: tensor" in message


def test_corrupt_header(family, tmp_path):
    task = copy_task(family, tmp_path)
    weights = task / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:12] = b"\xff\xfe{["
    weights.write_bytes(bytes(data))
    assert "corrupt header" in refused(family, tmp_path, task)


def test_huge_header_length(family, tmp_path):
    task = copy_task(family, tmp_path)
    weights = task / "model.safetensors"
    weights.write_bytes((2**40).to_bytes(8, "little") + weights.read_bytes()[8:])
    assert "truncated or not a safetensors file" in refused(family, tmp_path, task)


def sharded(family, tmp_path: Path) -> Path:
    task = copy_task(family, tmp_path)
    state = load_file(str(task / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[:10]}
    halves["model-00002-of-00002.safetensors"] = names[10:]
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(task / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (task / "model.safetensors").unlink()
    (task / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return task


def test_missing_shard(family, tmp_path):
    task = sharded(family, tmp_path)
    assert len(model_tensors(str(task), "model")) > 10
    (task / "model-00002-of-00002.safetensors").unlink()
    message = refused(family, tmp_path, task)
    assert "names the shard model-00002-of-00002.safetensors, which is missing" in (
        message
    )


def test_task_model_missing_a_tensor(family, tmp_path):
    task = copy_task(family, tmp_path)
    state = load_file(str(task / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(task / "model.safetensors"))
    message = refused(family, tmp_path, task)
    assert "Tensor model.layers.1.self_attn.k_proj.weight is in the base" in message


def test_missing_untied_lm_head_is_refused_not_merged_from_embeddings(family, tmp_path):
    task = copy_task(family, tmp_path)
    state = load_file(str(task / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(task / "model.safetensors"))
    message = refused(family, tmp_path, task)
    assert "lm_head.weight" in message and "embed_tokens" in message


def test_shape_mismatch_before_weights(family, tmp_path):
    task = copy_task(family, tmp_path)
    state = load_file(str(task / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = state[name][:, :16].contiguous()
    save_file(state, str(task / "model.safetensors"))
    message = refused(family, tmp_path, task)
    assert name in message and "(64, 16)" in message


class Evil:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_malicious_pickle_is_refused_without_running(family, tmp_path):
    task = copy_task(family, tmp_path)
    (task / "model.safetensors").unlink()
    with open(task / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"x": Evil()}, handle)
    message = refused(family, tmp_path, task)
    assert "weights-only" in message and "safetensors" in message


def test_weights_only_pickle_is_read(tmp_path):
    torch.save({"w": torch.zeros(3, 2)}, tmp_path / "pytorch_model.bin")
    found = model_tensors(str(tmp_path), "model")
    assert found["w"].shape == (3, 2)


def test_header_reader_checks_sizes(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4)}, str(path))
    assert safetensors_header(str(path), "model", "m")["a"].shape == (4,)
    path.write_bytes(b"\x01")
    with pytest.raises(RAMInputError, match="too short for a header"):
        safetensors_header(str(path), "model", "m")
