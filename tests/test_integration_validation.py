"""Configuration checks: every refused input before any weight is read, and
every key RAM ignores as stock mergekit ignores it (a warning, then the merge).

The cases live in tests/rejected_inputs.py, one list that drives both the
parametrized test below and the docs/errors.md table of their messages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import reference
import torch
import yaml
from click.testing import CliRunner
from conftest import merge
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from rejected_inputs import (
    CASES,
    ERRORS_PAGE,
    REGENERATE,
    Outcome,
    Workspace,
    errors_block,
    no_weight_reads,
    placeholders,
    render_table,
    run_case,
    warnings_logged,
)
from safetensors.torch import load_file

import mergekit_ram
from mergekit_ram.commands.synthetic import build_models
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.validation import check_config

ANALYZE = "mergekit-ram analyze"

EXAMPLES = Path(__file__).resolve().parent.parent / "example_configs"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def workspace(family_f32, tmp_path_factory) -> Workspace:
    return Workspace(family_f32, tmp_path_factory.mktemp("rejected"))


@pytest.fixture(scope="module")
def outcomes(workspace) -> dict[str, Outcome]:
    """Every case run once through the CLI (shared by the table test)."""
    found = {case.id: run_case(case, workspace) for case in CASES}
    assert len(found) == len(CASES), "two cases share an id"
    return found


def config_of(document: dict) -> MergeConfiguration:
    return MergeConfiguration.model_validate(document)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_refused_or_warned_with_a_message(case, outcomes, workspace):
    outcome = outcomes[case.id]
    assert "Traceback" not in outcome.output
    assert outcome.message, outcome.output
    for fragment in case.expect:
        assert fragment in outcome.message, outcome.message
    out = workspace.root / f"out-{case.id}"
    if case.kind == "warning":  # the merge runs as stock mergekit's would
        assert outcome.exit_code == 0, outcome.output
        assert (out / "model.safetensors").is_file()
        return
    assert outcome.exit_code == 2, outcome.output
    # Refused before OUT is made; a merge that failed leaves nothing behind.
    assert not out.exists() or case.stage == "merge" and not any(out.iterdir())


def test_errors_page_table_matches_the_messages(outcomes):
    table = render_table(outcomes)
    block = errors_block(ERRORS_PAGE.read_text(encoding="utf-8"))
    if block != table:
        pytest.fail(
            "docs/errors.md's table of rejected inputs differs from the messages the "
            f"code prints; regenerate it with `{REGENERATE}`."
        )


@pytest.mark.parametrize(
    "r, error, match",
    [(-1, ValueError, "parameters.r"), (0.5, AssertionError, "checkpoint")],
)
def test_python_api_refuses_before_reading(r, error, match, family_f32, tmp_path):
    """A bad r is refused before any read; the guard the config-stage cases
    run under does see the reads of a good one."""
    config = config_of(family_f32.config_dict("ramplus", parameters={"r": r}))
    with no_weight_reads(), pytest.raises(error, match=match):
        mergekit_ram.run_merge(config, str(tmp_path / "out"), MergeOptions(quiet=True))
    assert error is AssertionError or not (tmp_path / "out").exists()


def test_example_configs_pass(tmp_path, monkeypatch):
    build_models(str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    names = sorted(EXAMPLES.glob("*.yml"))
    assert names
    for path in names:
        config = config_of(yaml.safe_load(path.read_text(encoding="utf-8")))
        with no_weight_reads():
            assert not check_config(config, MergeOptions()).warnings
            check_config(config, MergeOptions(), user=ANALYZE)


VALID = {
    "paper-defaults": dict(method="ramplus"),
    "ram": dict(method="ram", parameters={"epsilon": 1e-5}),
    "epsilon-as-yaml-string": dict(parameters={"epsilon": "1e-5"}),
    "constant-gradient": dict(parameters={"r": [0.2, 0.2]}),
    "filters-with-tensor-scope": dict(
        parameters={
            "statistics": "tensor",
            "r": [{"filter": "mlp", "value": 0.4}, {"value": 0.1}],
        }
    ),
    "filters-with-r-0": dict(
        method="ram",
        parameters={"epsilon": [{"filter": "mlp", "value": 1e-4}, {"value": 1e-5}]},
    ),
    "base-among-the-models": dict(tasks=["base", "alpha", "beta", "gamma"]),
    "explicit-scales": dict(
        parameters={"unique_scale": 1.0},
        model_parameters={"alpha": {"unique_scale": 1.2}, "beta": {"unique_scale": 1}},
    ),
}


@pytest.mark.parametrize("name", sorted(VALID))
def test_valid_family_configs_pass(name, family_f32):
    config = config_of(family_f32.config_dict(**VALID[name]))
    before = config.model_dump()
    with no_weight_reads():
        assert not check_config(config).warnings
    assert config.model_dump() == before


def test_model_paths_with_a_space_and_a_quote_pass(family_f32, tmp_path):
    """mergekit 0.1.5 cannot write such a path as JSON; the checks need not."""
    for name, path in family_f32.paths.items():
        (tmp_path / f'{name} "q"').symlink_to(path)
    document = family_f32.config_dict("ramplus", base_model=f'{tmp_path}/base "q"')
    for entry, name in zip(document["models"], family_f32.tasks):
        entry["model"] = f'{tmp_path}/{name} "q"'
    with no_weight_reads():
        assert not check_config(config_of(document)).warnings


def test_slices_with_the_base_pass(family_f32):
    names = ("base", *family_f32.tasks)
    sources = [{"model": family_f32.paths[n], "layer_range": [0, 2]} for n in names]
    slices = [{"sources": sources}]
    document = family_f32.config_dict(parameters={"r": 0.2}, models=None, slices=slices)
    check_config(config_of(document))


def test_a_slice_of_the_base_alone_merges_as_stock_does(family_f32, tmp_path):
    """Keep the lower layers, merge the upper: one task model per
    configuration is the rule, not per slice."""
    names = ("base", *family_f32.tasks)
    upper = [{"model": family_f32.paths[n], "layer_range": [1, 2]} for n in names]
    lower = [{"model": family_f32.base, "layer_range": [0, 1]}]
    slices = [{"sources": lower}, {"sources": upper}]
    document = family_f32.config_dict("ram", models=None, slices=slices)
    merged = load_file(merge(document, tmp_path / "out") / "model.safetensors")
    base, *tasks = (family_f32.state(n) for n in names)
    expected, _ = reference.merge(base, tasks)
    for name in (n for n in merged if ".layers." in n):
        want = (base if ".layers.0." in name else expected)[name]
        assert torch.equal(merged[name], want), name


def test_revisions_and_adapters_are_other_models(family_f32, tmp_path):
    """Branches of one repo, and BASE+adapter, are models of their own (as
    for stock mergekit); the same name and revision twice is refused."""
    (adapter := tmp_path / "adapter").mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    document = family_f32.config_dict("ramplus")
    adapted = f"{family_f32.base}+{adapter}"
    names = ["agents/checkpoints@coder", "agents/checkpoints@tool", adapted]
    document["models"] = [{"model": name} for name in names]
    with no_weight_reads():
        check_config(config_of(document))
    document["models"].append({"model": "agents/checkpoints@tool"})
    with pytest.raises(
        RAMInputError, match=r"models\[3\].*already listed as models\[1\]"
    ):
        check_config(config_of(document))


def test_local_models_are_checked_whatever_the_base(family_f32, tmp_path, monkeypatch):
    """A name spelled like a hub id that is no local folder is mergekit's to
    fetch: validation asks nothing of the hub, and checks each local task
    model alone: a truncated one is refused before anything is downloaded."""
    import huggingface_hub

    no_network = mock.Mock(side_effect=AssertionError("validation looked a model up"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setattr(huggingface_hub, "get_session", no_network)
    document = family_f32.config_dict("ramplus", base_model="some-org/base")
    check_config(config_of(document))
    cut = tmp_path / "cut"
    shutil.copytree(family_f32.paths["alpha"], cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    document["models"][0]["model"] = str(cut)
    with pytest.raises(RAMInputError, match="cut: model.safetensors is not a valid"):
        check_config(config_of(document))


def test_an_input_inside_out_merges(family_f32, tmp_path):
    """OUT a project folder holding ./models/x: publishing writes only OUT's
    top-level entries, so the input is never touched."""
    project = tmp_path / "project"
    shutil.copytree(family_f32.paths["gamma"], project / "models" / "gamma")
    before = (project / "models" / "gamma" / "model.safetensors").read_bytes()
    document = family_f32.config_dict("ramplus")
    document["models"][2]["model"] = str(project / "models" / "gamma")
    merge(document, project)
    assert (project / "model.safetensors").exists()
    assert (project / "models" / "gamma" / "model.safetensors").read_bytes() == before


def test_other_methods_are_left_alone(family_f32, tmp_path):
    document = family_f32.config_dict(
        "ties",
        parameters={"rescale_factor": 1.2},
        base_model=str(tmp_path / "missing"),
    )
    config = config_of(document)
    assert not check_config(config).warnings
    with pytest.raises(RAMInputError, match="missing does not exist"):
        check_config(config, user=ANALYZE)


# Mistakes stock mergekit silently ignored (or met with a traceback): refused
# by `mergekit-yaml` itself too, with the message `mergekit-ram merge` prints.
# mergekit-yaml's safe_load keeps the last of a key written twice: the wrapper
# reads the text it was given again and refuses the repeat.
DROPPED = [
    case
    for case in CASES
    if case.id.split("-")[0] in ("key", "parameter", "two", "method")
    and case.kind == "error"
    or case.id == "yaml-duplicate-key"
]


@pytest.mark.parametrize("case", DROPPED, ids=lambda case: case.id)
def test_stock_mergekit_yaml_refuses_the_same_mistakes(
    case, outcomes, workspace, monkeypatch
):
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    mergekit_ram.install()
    assert len(DROPPED) == 11
    config = workspace.root / f"{case.id}.yml"  # written by the outcomes run
    out = workspace.root / f"stock-{case.id}"
    monkeypatch.chdir(workspace.root)
    with no_weight_reads():
        result = CliRunner().invoke(mergekit_yaml, [str(config), str(out)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    printed = placeholders(result.output, workspace).strip()
    said = outcomes[case.id].message
    if case.id.startswith("yaml"):  # the wrapper re-reads text, not the file
        said = "The configuration: " + said.split(": ", 1)[1]
    assert printed == f"Error: {said}"
    assert not out.exists()


# --- a good guest (issue 35) ----------------------------------------------------

# What a linear or TIES template carries, with merge_method switched to ram.
TEMPLATES = {
    "linear": dict(
        parameters={"normalize": True},
        model_parameters={"alpha": {"weight": 0.6}, "beta": {"weight": 0.4}},
    ),
    "ties": dict(
        parameters={"normalize": True, "int8_mask": True, "lambda": 1.0},
        model_parameters={
            name: {"weight": 0.5, "density": 0.5} for name in ("alpha", "beta")
        },
    ),
}


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_a_template_switched_to_ram_merges_as_stock_does(
    template, family_f32, tmp_path
):
    """Stock mergekit ignores what `ram` does not use: so do we, with one
    warning line per ignored key on mergekit-yaml's stderr, and the weights
    of the same merge without those keys."""
    from mergekit.scripts.run_yaml import main as stock_mergekit_yaml

    mergekit_ram.install()
    runs = {}
    for stem, keys in (("plain", {}), ("templated", TEMPLATES[template])):
        (path := tmp_path / f"{stem}.yml").write_text(family_f32.yaml("ram", **keys))
        with warnings_logged() as runs[stem]:
            args = [str(path), str(tmp_path / f"out-{stem}")]
            result = CliRunner().invoke(stock_mergekit_yaml, args)
        assert result.exit_code == 0, result.output
    warned = runs["templated"]
    keys = {
        f"models[{i}].parameters.{key}"
        for i, name in enumerate(family_f32.tasks)
        for key in TEMPLATES[template]["model_parameters"].get(name, {})
    } | {f"parameters.{key}" for key in TEMPLATES[template]["parameters"]}
    assert len(warned) == len(keys), warned
    assert all(any(line.startswith(k) for line in warned) for k in keys)
    assert not runs["plain"]
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "out-plain" / name).read_bytes() == (
            tmp_path / "out-templated" / name
        ).read_bytes()


@pytest.mark.parametrize("method", ["rammplus", "no_such_method"])
def test_an_unknown_method_raises_what_mergekit_raises(method, family_f32, tmp_path):
    """From Python a RuntimeError, as stock mergekit's run_merge raises,
    through our run_merge and mergekit's own; OUT is not made."""
    from mergekit import merge as mergekit_merge

    mergekit_ram.install()
    config = config_of(family_f32.config_dict(method))
    for run_merge in (mergekit_ram.run_merge, mergekit_merge.run_merge):
        with pytest.raises(RuntimeError, match=f"'{method}' is not a merge method"):
            run_merge(config, str(tmp_path / "out"), MergeOptions(quiet=True))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["linear", "ties", "task_arithmetic"])
def test_other_methods_print_and_write_what_stock_mergekit_does(
    method, family_f32, tmp_path
):
    """Stdout, stderr and every file of a non-RAM merge are the host's, byte
    for byte, with and without the plugin (the output-config warning too).
    The card lists the models in the order of a set, which differs from run
    to run in stock mergekit itself: its lines are compared as a multiset."""
    config = tmp_path / "config.yml"
    names = ["base", *family_f32.tasks]
    weights = {name: {"weight": 0.5, "density": 0.5} for name in names}
    config.write_text(family_f32.yaml(method, tasks=names, model_parameters=weights))
    runs, files = {}, {}
    for plugin in (True, False):
        out = tmp_path / str(plugin) / "merged"
        env = {**os.environ, "MERGEKIT_RAM_AUTOLOAD": str(int(plugin))}
        command = [str(BIN / "mergekit-yaml"), str(config), str(out), "--quiet"]
        runs[plugin] = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=300
        )
        assert runs[plugin].returncode == 0, runs[plugin].stderr
        files[plugin] = {
            p.relative_to(out): sorted(p.read_bytes().splitlines())
            if p.name == "README.md"
            else p.read_bytes()
            for p in out.rglob("*")
            if p.is_file()
        }
    assert runs[True].stdout == runs[False].stdout
    assert runs[True].stderr == runs[False].stderr
    assert files[True] == files[False] and files[True]
