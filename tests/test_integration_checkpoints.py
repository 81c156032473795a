"""Headers before weights (issue finding 9, issue 17 items 5, 7 and 10): every
input's checkpoint files are checked from their headers (validated by the
safetensors library), and problems are one Error paragraph, no traceback."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from mergekit.config import MergeConfiguration
from rejected_inputs import no_weight_reads
from safetensors.torch import load_file, save_file

from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import (
    check_models,
    model_tensors,
    safetensors_header,
)
from mergekit_ram.integration.validation import check_config


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
    assert "model.safetensors is not a valid safetensors file" in message
    assert "file not fully covered" in message


def test_corrupt_header(family, tmp_path):
    task = copy_task(family, tmp_path)
    weights = task / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:12] = b"\xff\xfe{["
    weights.write_bytes(bytes(data))
    assert "invalid UTF-8 in header" in refused(family, tmp_path, task)


def test_huge_header_length(family, tmp_path):
    task = copy_task(family, tmp_path)
    weights = task / "model.safetensors"
    weights.write_bytes((2**40).to_bytes(8, "little") + weights.read_bytes()[8:])
    assert "header too large" in refused(family, tmp_path, task)


def raw_safetensors(path: Path, header: dict, data_bytes: int) -> None:
    """A safetensors file with exactly this JSON header and zeroed data."""
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data_bytes))


def f32(begin, end, shape=None) -> dict:
    shape = [(end - begin) // 4] if shape is None else shape
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


# Headers the hand parser let through (or crashed on); safetensors refuses them.
CORRUPT = {
    "overlapping-offsets": ({"a": f32(0, 8), "b": f32(4, 12)}, 12, "invalid offset"),
    "trailing-bytes": ({"a": f32(0, 8)}, 16, "not fully covered"),
    "non-string-metadata": (
        {"__metadata__": {"format": 1}, "a": f32(0, 8)},
        8,
        "expected a string",
    ),
    "negative-shape": ({"a": f32(0, 8, shape=[-2])}, 8, "expected usize"),
    "float-offsets": (
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}},
        8,
        "expected usize",
    ),
    "unknown-dtype": (
        {"a": {"dtype": "F12", "shape": [2], "data_offsets": [0, 8]}},
        8,
        "unknown variant",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_safetensors_refused_before_weights(case, family, tmp_path):
    header, size, reason = CORRUPT[case]
    task = copy_task(family, tmp_path)
    raw_safetensors(task / "model.safetensors", header, size)
    message = refused(family, tmp_path, task)
    assert "model.safetensors is not a valid safetensors file" in message
    assert reason in message and message.count("Error:") == 1


def test_folder_named_model_safetensors(family, tmp_path):
    task = copy_task(family, tmp_path)
    (task / "model.safetensors").unlink()
    (task / "model.safetensors").mkdir()
    message = refused(family, tmp_path, task)
    assert "model.safetensors is a folder, where a regular file belongs" in message


@pytest.mark.parametrize("file", ["model.safetensors", "config.json"])
def test_named_pipe_refused_without_opening_it(file, family, tmp_path):
    """A FIFO blocks whoever opens it (the header check, transformers reading
    config.json) forever; a watchdog unblocks a reader after
    30 s so that a regression fails instead of hanging."""
    task = copy_task(family, tmp_path)
    pipe = task / file
    pipe.unlink()
    os.mkfifo(pipe)

    def unblock():
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    watchdog = threading.Timer(30, unblock)
    watchdog.start()
    try:
        message = refused(family, tmp_path, task)
    finally:
        watchdog.cancel()
    assert f"{file} is a named pipe (FIFO)" in message


def test_dangling_symlink_reported_as_such(family, tmp_path):
    task = copy_task(family, tmp_path)
    (task / "model.safetensors").unlink()
    (task / "model.safetensors").symlink_to(tmp_path / "gone.safetensors")
    message = refused(family, tmp_path, task)
    assert "model.safetensors is a symlink to" in message
    assert "which does not exist" in message and "lm_head" not in message


def test_unreadable_file_reported_as_such(family, tmp_path, monkeypatch):
    """Issue 27 item 11: a file without read permission was "No such file …
    truncated, corrupt". (As root chmod cannot take the permission away: the
    refusal the OS gives a user is stood in for.)"""
    import mergekit_ram.integration.checkpoints as headers

    task = copy_task(family, tmp_path)
    real_open = open

    def refuse(path, *args, **kwargs):
        if str(path) == str(task / "model.safetensors"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(headers, "open", refuse, raising=False)
    message = refused(family, tmp_path, task)
    assert "model.safetensors cannot be read (Permission denied)" in message
    assert "chmod a+r" in message and "corrupt" not in message


def with_extra(task: Path, tensors: dict[str, torch.Tensor]) -> None:
    state = load_file(str(task / "model.safetensors"))
    state.update(tensors)
    save_file(state, str(task / "model.safetensors"))


def test_unsigned_and_e8m0_dtypes_are_read(tmp_path):
    """Valid dtypes the hand parser called a "corrupt header"."""
    path = tmp_path / "model.safetensors"
    dtypes = [torch.uint16, torch.uint32, torch.uint64, torch.float8_e8m0fnu]
    save_file({str(d): torch.ones(3).to(d) for d in dtypes}, str(path))
    found = model_tensors(str(tmp_path), "model")
    assert {name: t.dtype for name, t in found.items()} == {str(d): d for d in dtypes}


def test_unsigned_buffers_pass_the_checks(family, tmp_path):
    """Stock mergekit merges models with uint16/32/64 tensors (it copies an
    agreed buffer); so does the check: RAM copies the base's."""
    extra = {
        f"model.u{bits}": torch.arange(4).to(getattr(torch, f"uint{bits}"))
        for bits in (16, 32, 64)
    }
    paths = {}
    for name in ("base", "alpha"):
        paths[name] = copy_task(family, tmp_path, name)
        with_extra(paths[name], extra)
    check_models(
        ("base_model", str(paths["base"])),
        [("models[0].model", str(paths["alpha"]))],
        compare=True,
        vocabulary_free=False,
    )


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_weights_refused_with_a_clear_message(dtype, family, tmp_path):
    """Stock mergekit fails on float8 weights ("add_stub" not implemented for
    'Float8_e4m3fn'); RAM's checks said "sum_cpu" deep in the merge."""
    task = copy_task(family, tmp_path)
    state = load_file(str(task / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = state[name].to(dtype)
    save_file(state, str(task / "model.safetensors"))
    message = refused(family, tmp_path, task)
    assert f"Tensor {name} of models[1].model {task}" in message
    assert "torch has no arithmetic" in message and "bfloat16" in message


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
        pickle.dump({"x": Evil()}, handle, protocol=2)  # torch.load's own
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
    with pytest.raises(RAMInputError, match="header too small"):
        safetensors_header(str(path), "model", "m")


def test_float8_outside_the_architecture_is_not_refused(family, tmp_path):
    """Stock mergekit merges models with an F8_E8M0 (or float8) tensor its
    architecture never reads; so does RAM. check_models alone, not knowing
    the architecture, refuses it."""
    extra = {
        "model.extra_scale": torch.ones(4).to(torch.float8_e8m0fnu),
        "model.extra_weight": torch.ones(4).to(torch.float8_e4m3fn),
    }
    paths = {}
    for name in family.paths:
        paths[name] = copy_task(family, tmp_path, name)
        with_extra(paths[name], extra)
    document = family.config_dict("ramplus")
    document["base_model"] = str(paths["base"])
    for entry, name in zip(document["models"], family.tasks):
        entry["model"] = str(paths[name])
    with no_weight_reads():
        check_config(MergeConfiguration.model_validate(document))
    with pytest.raises(RAMInputError, match="model.extra_"):
        check_models(
            ("base_model", str(paths["base"])), [], compare=True, vocabulary_free=False
        )
