"""Failures stay honest: the user's input and environment get one `Error:`
paragraph (exit 2), a bug of ours its traceback (exit 1), from `mergekit-yaml`
as a user types it and from `mergekit_ram.run_merge`; OUT is left as it was."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram
from mergekit_ram.core.errors import RAMInputError

# Started before the merge (sitecustomize on PYTHONPATH): the kernel raises,
# or the disk is full when mergekit writes a shard.
INJECT = {
    "bug": """
        import mergekit_ram.core.kernel as kernel
        def broken(*args, **kwargs):
            raise ZeroDivisionError("injected")
        kernel.ram_merge_tensor = broken
    """,
    "full disk": """
        import safetensors, safetensors.torch
        def full(tensors, filename, *args, **kwargs):
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: "
                "No space left on device (os error 28)"
            )
        safetensors.torch.save_file = full
    """,
}


def mergekit_yaml(tmp_path, config: dict, out, inject: str | None = None):
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if inject:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(INJECT[inject]))
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(site), env.get("PYTHONPATH")])
        )
    command = os.path.join(os.path.dirname(sys.executable), "mergekit-yaml")
    return subprocess.run(
        [command, str(path), str(out)], env=env, capture_output=True, text=True
    )


def test_a_bug_of_ours_keeps_its_traceback_and_exits_1(family_f32, tmp_path):
    out = tmp_path / "out"
    result = mergekit_yaml(tmp_path, family_f32.config_dict("ram"), out, "bug")
    assert result.returncode == 1, result.stderr
    assert "Traceback" in result.stderr
    assert result.stderr.rstrip().endswith("ZeroDivisionError: injected")
    assert f"mergekit-ram: the merge stopped: {out} is as it was." in result.stderr
    assert "\nError:" not in result.stderr and not out.exists()


def test_a_full_disk_is_one_error_naming_the_path_and_the_reason(family_f32, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = mergekit_yaml(tmp_path, family_f32.config_dict("ram"), out, "full disk")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    said = result.stderr[result.stderr.index("Error:") :].strip()
    assert said.startswith(f"Error: The merge into {out} stopped: No space left")
    assert f"{out} is as it was." in said
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_typo_is_one_error_and_exits_2(family_f32, tmp_path):
    config = family_f32.config_dict("ramplus", parameters={"epsilonn": 0.1})
    result = mergekit_yaml(tmp_path, config, tmp_path / "out")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    said = result.stderr[result.stderr.index("Error:") :]
    assert "epsilonn" in said and "epsilon" in said.replace("epsilonn", "")
    assert not (tmp_path / "out").exists()


def run_merge(family, out, **parameters) -> None:
    config = MergeConfiguration.model_validate(
        family.config_dict("ram", parameters=parameters or None)
    )
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True))


def test_python_callers_get_the_original_exception(
    family_f32, tmp_path, monkeypatch, capsys
):
    import mergekit_ram.integration.methods as methods

    def broken(*args, **kwargs):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(methods, "ram_merge_tensor", broken)
    with pytest.raises(ZeroDivisionError, match="injected"):
        run_merge(family_f32, tmp_path / "out")
    assert "the merge stopped" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_python_callers_get_an_input_error_for_the_environment(
    family_f32, tmp_path, monkeypatch
):
    import safetensors.torch

    def full(tensors, filename, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(RAMInputError, match="No space left on device") as caught:
        run_merge(family_f32, tmp_path / "out")
    causes = [caught.value]
    while causes[-1].__cause__ is not None:
        causes.append(causes[-1].__cause__)
    assert isinstance(causes[-1], OSError)
    with pytest.raises(RAMInputError, match="epsilonn"):
        run_merge(family_f32, tmp_path / "out2", epsilonn=1e-5)
