"""Checkpoint headers beyond the refused inputs of rejected_inputs.py: what
must pass (as stock mergekit merges it), and a file the OS will not let us read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import merge
from mergekit.config import MergeConfiguration
from rejected_inputs import no_weight_reads
from safetensors.torch import load_file, save_file

import mergekit_ram
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


def test_unsigned_buffers_and_pickles_pass_the_checks(family_f32, tmp_path):
    """Stock mergekit merges models with uint16/32/64 tensors (it copies an
    agreed buffer); so does the check: RAM copies the base's. mergekit's
    loader unpickles weights only: a .bin task model beside a safetensors base
    is not read here, nor taken for one missing tensors."""
    extra = {
        f"model.u{bits}": torch.arange(4).to(getattr(torch, f"uint{bits}"))
        for bits in (16, 32, 64)
    }
    paths = copies(family_f32, tmp_path, extra)
    (pickled := tmp_path / "pickled").mkdir()
    torch.save(family_f32.state("alpha"), pickled / "pytorch_model.bin")
    assert model_tensors(str(pickled), "models[1].model") is None
    tasks = [("models[0].model", paths["alpha"]), ("models[1].model", str(pickled))]
    base = ("base_model", paths["base"])
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
    mergekit_ram.install()
    document = family_f32.config_dict("ramplus", base_model=paths["base"])
    for entry, name in zip(document["models"], family_f32.tasks):
        entry["model"] = paths[name]
    with no_weight_reads():
        check_config(MergeConfiguration.model_validate(document))
    with pytest.raises(RAMInputError, match="model.extra_"):
        base = ("base_model", paths["base"])
        check_models(base, [], compare=True, vocabulary_free=False)


def test_float8_with_dtype_merges_as_stock_casts_it(family_f32, tmp_path):
    """With `dtype:` mergekit casts every tensor on load, so stock merges an
    FP8 tensor: RAM does too, equal to the merge of the cast model."""
    up = "model.layers.0.mlp.up_proj.weight"
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("cast", torch.bfloat16)):
        shutil.copytree(family_f32.paths["beta"], tmp_path / name)
        state = load_file(tmp_path / name / "model.safetensors")
        state[up] = state[up].to(torch.float8_e4m3fn).to(dtype)
        save_file(state, tmp_path / name / "model.safetensors")
    merged = {}
    for name in ("fp8", "cast"):
        document = family_f32.config_dict("ramplus", dtype="bfloat16")
        document["models"][1]["model"] = str(tmp_path / name)
        out = merge(document, tmp_path / f"out-{name}")
        merged[name] = (out / "model.safetensors").read_bytes()
    assert merged["fp8"] == merged["cast"]
