"""Checkpoint headers beyond the refused inputs of rejected_inputs.py: what
must pass (as stock mergekit merges it), and a file the OS will not let us read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from mergekit.config import MergeConfiguration
from rejected_inputs import no_weight_reads
from safetensors.torch import load_file, save_file

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import check_models, model_tensors
from mergekit_ram.integration.validation import check_config


def copies(family, tmp_path: Path, extra: dict[str, torch.Tensor]) -> dict[str, str]:
    """Every family model copied, with `extra` tensors added."""
    paths = {}
    for name in family.paths:
        path = tmp_path / name
        shutil.copytree(family.paths[name], path)
        state = load_file(path / "model.safetensors")
        save_file({**state, **extra}, path / "model.safetensors")
        paths[name] = str(path)
    return paths


def test_unsigned_buffers_pass_the_checks(family_f32, tmp_path):
    """Stock mergekit merges models with uint16/32/64 tensors (it copies an
    agreed buffer); so does the check: RAM copies the base's."""
    extra = {
        f"model.u{bits}": torch.arange(4).to(getattr(torch, f"uint{bits}"))
        for bits in (16, 32, 64)
    }
    paths = copies(family_f32, tmp_path, extra)
    base, tasks = ("base_model", paths["base"]), [("models[0].model", paths["alpha"])]
    check_models(base, tasks, compare=True, vocabulary_free=False)


def test_float8_outside_the_architecture_is_not_refused(family_f32, tmp_path):
    """Stock mergekit merges models with a float8 (or F8_E8M0) tensor its
    architecture never reads; so does RAM. check_models alone, not knowing
    the architecture, refuses it."""
    extra = {
        "model.extra_scale": torch.ones(4).to(torch.float8_e8m0fnu),
        "model.extra_weight": torch.ones(4).to(torch.float8_e4m3fn),
    }
    paths = copies(family_f32, tmp_path, extra)
    document = family_f32.config_dict("ramplus", base_model=paths["base"])
    for entry, name in zip(document["models"], family_f32.tasks):
        entry["model"] = paths[name]
    with no_weight_reads():
        check_config(MergeConfiguration.model_validate(document))
    with pytest.raises(RAMInputError, match="model.extra_"):
        base = ("base_model", paths["base"])
        check_models(base, [], compare=True, vocabulary_free=False)


def test_weights_only_pickle_is_read(tmp_path):
    torch.save({"w": torch.zeros(3, 2)}, tmp_path / "pytorch_model.bin")
    assert model_tensors(str(tmp_path), "model")["w"].shape == (3, 2)


def test_unreadable_file_reported_as_such(tmp_path, monkeypatch):
    """A file without read permission is not "truncated, corrupt". (As root
    chmod cannot take the permission away: the OS's refusal is stood in for.)"""
    import mergekit_ram.integration.checkpoints as headers

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, weights)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(headers, "open", refuse, raising=False)
    with pytest.raises(RAMInputError) as caught:
        model_tensors(str(tmp_path), "models[1].model")
    message = str(caught.value)
    assert "model.safetensors cannot be read (Permission denied)" in message
    assert "chmod a+r" in message and "corrupt" not in message
