"""Installing into mergekit: all or nothing, and fail closed when the host changed.

In-process: registration, undoing a failed install, and
every entry point refusing ours (and only ours) once install failed. Against
copies of mergekit with one change each (changed_host): stock methods exactly
as on that copy without the plugin, ours byte-identical or refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import Mock

import pytest
import yaml
from changed_host import CHANGES, REFUSED, SAME, host_copy
from click.testing import CliRunner
from mergekit import merge as mergekit_merge
from mergekit import merge_methods
from mergekit.config import MergeConfiguration
from mergekit.merge_methods import GroupMergeMethod
from mergekit.merge_methods import ram as stock_ram
from mergekit.options import MergeOptions
from mergekit.plan import MergePlanner
from mergekit.scripts.run_yaml import main as mergekit_yaml

import mergekit_ram
from mergekit_ram.commands.cli import main
from mergekit_ram.integration import install, statistics
from mergekit_ram.integration.errors import IncompatibleMergekit
from mergekit_ram.integration.methods import RAMMerge, ram, ramplus

PATCHED = [(MergePlanner, "_plan"), (MergePlanner, "plan_to_disk")]
PATCHED += [(mergekit_merge, "run_merge"), (mergekit_merge, "generate_card")]


def test_ours_answer_for_ram_and_ramplus_once():
    """`ram` is ours, `ramplus` registered (mergekit's public register), stock's
    tensor-local variant left alone; installing again changes nothing."""
    assert merge_methods.get("ram") is ram and merge_methods.get("ramplus") is ramplus
    assert ramplus in merge_methods.registered_methods()
    assert merge_methods.get("ramplus_tl") is stock_ram.ramplus_tl_merge
    before = [getattr(owner, name) for owner, name in PATCHED]
    mergekit_ram.install()
    mergekit_ram.install(eager=False)
    assert [getattr(owner, name) for owner, name in PATCHED] == before


@pytest.fixture
def uninstalled(monkeypatch):
    """mergekit as before any install (the lookup still routed): the next
    lookup of ours or install() installs again; restored afterwards."""
    from mergekit.scripts import run_yaml

    monkeypatch.setattr(install, "_installed", {})
    for owner, name in PATCHED:
        monkeypatch.setattr(owner, name, getattr(owner, name).__mergekit_ram__)
    monkeypatch.setattr(run_yaml, "run_merge", mergekit_merge.run_merge)


def test_a_failed_install_undoes_every_change(uninstalled, monkeypatch):
    stock = [getattr(owner, name) for owner, name in PATCHED]
    refuse = ValueError("no more wrappers")
    monkeypatch.setattr(statistics, "patched_plan_to_disk", Mock(side_effect=refuse))
    with pytest.raises(ValueError, match="no more wrappers"):
        mergekit_ram.install()
    assert [getattr(owner, name) for owner, name in PATCHED] == stock
    assert not install._installed


def test_a_bug_of_ours_while_installing_keeps_its_traceback(uninstalled, monkeypatch):
    """Only the host's missing names are an incompatible mergekit."""
    ours = "mergekit_ram.integration.publishing"
    monkeypatch.setitem(sys.modules, ours, None)
    with pytest.raises(ModuleNotFoundError, match=ours):
        mergekit_ram.install()


@pytest.fixture
def changed(uninstalled, monkeypatch):
    """A mergekit whose align_dtype moved: nothing installs."""
    from mergekit.merge_methods import dtype

    monkeypatch.delattr(dtype, "align_dtype")


def test_changed_host_refuses_ours_everywhere_before_out(changed, family, tmp_path):
    """mergekit's lookup, run_merge, merge_state_dicts, mergekit-yaml and ours
    refuse `ram` / `ramplus` with one message naming the change, before OUT
    exists; stock methods are mergekit's own."""
    text = family.yaml("ram")
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    models = [family.state("base"), family.state(family.tasks[0])]
    calls = {
        "get": lambda out: merge_methods.get("ramplus"),
        "run_merge": lambda out: mergekit_merge.run_merge(config, out, MergeOptions()),
        "ours": lambda out: mergekit_ram.run_merge(config, out, MergeOptions()),
        "state dicts": lambda out: merge_methods.merge_state_dicts(
            models, "ram", base=0
        ),
    }
    for name, call in calls.items():
        out = tmp_path / name
        with pytest.raises(IncompatibleMergekit) as error:
            call(str(out))
        assert "dtype.align_dtype is missing" in error.value.message, name
        assert not out.exists(), name
    assert merge_methods.get("linear").spec.name == "linear"
    (tmp_path / "ram.yml").write_text(text, encoding="utf-8")
    for command, args in ((main, ["merge"]), (mergekit_yaml, [])):
        out = tmp_path / f"cli{len(args)}"
        args = [*args, str(tmp_path / "ram.yml"), str(out)]
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 2 and REFUSED in result.output, result.output
        assert not out.exists()
    result = CliRunner().invoke(main, ["--version"])
    assert "NOT installed" in result.output and "align_dtype" in result.output


def test_global_ramplus_without_its_hook_is_refused(family, monkeypatch):
    """Never per-tensor λ where global was asked: with our `_execute` not
    reached, the in-memory merge raises instead."""
    monkeypatch.setattr(RAMMerge, "_execute", GroupMergeMethod._execute)
    models = [family.state("base"), *family.task_states()]
    with pytest.raises(IncompatibleMergekit, match="without whole-model λ"):
        merge_methods.merge_state_dicts(models, "ramplus", base=0)


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("install", seed=23)


# --- copies of mergekit with one change each ----------------------------------


@pytest.fixture(scope="module")
def configs(family, tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    methods = {
        "linear": ("linear", {"weight": 1.0}),
        "ram": ("ram", None),
        "ramplus": ("ramplus", {"r": 0.3, "alpha": 1.0}),
        "ramplus tensor": ("ramplus", {"r": 0.3, "statistics": "tensor"}),
    }
    paths = {name: root / f"{name.replace(' ', '_')}.yml" for name in methods}
    for name, (method, parameters) in methods.items():
        paths[name].write_text(family.yaml(method, parameters=parameters))
    return {name: str(path) for name, path in paths.items()}


def launch(root: Path, configs: dict, plugin: bool) -> subprocess.Popen:
    (root / "configs.json").write_text(json.dumps(configs), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    env |= {} if plugin else {"MERGEKIT_RAM_AUTOLOAD": "0"}
    driver = Path(__file__).with_name("changed_host.py")
    command = [sys.executable, str(driver), str(root), "1" if plugin else "0"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.Popen(command, cwd=root, env=env, text=True, **pipes)


def outcomes(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(configs, tmp_path_factory):
    """Every entry point on an unchanged copy: all merge."""
    root = host_copy(tmp_path_factory.mktemp("none"), "none")
    found = outcomes(launch(root, configs, plugin=True))
    assert all(r["code"] == 0 and r["files"] for r in found.values()), found
    return found


def sweep(change: str, configs: dict, request: pytest.FixtureRequest, root: Path):
    with_, without = (
        launch(host_copy(root / p, change), configs, p == "with")
        for p in ("with", "without")
    )
    ours, stock = outcomes(with_), outcomes(without)
    assert ours.pop("mergekit-yaml linear") == stock["mergekit-yaml linear"]
    assert stock["mergekit-yaml linear"]["code"] == 0
    for label, got in ours.items():
        if change in SAME:
            assert got == request.getfixturevalue("reference")[label], label
        else:
            assert got["files"] is None and REFUSED in got["error"], (label, got)
            assert got["code"] in (2, None), (label, got)  # commands 2, API raises
            if got["code"] is None:
                assert got["error"].startswith("IncompatibleMergekit"), (label, got)


@pytest.mark.slow
@pytest.mark.parametrize("change", sorted(set(CHANGES) - {"none"}))
def test_every_change_merges_the_same_or_refuses(change, configs, request, tmp_path):
    """Among them "MergePlanner._plan renamed", which merged with per-tensor λ
    and no statistics, exit 0 (test_integration_host's probe refuses it
    in-process in the default run)."""
    sweep(change, configs, request, tmp_path)
