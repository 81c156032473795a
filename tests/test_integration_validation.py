"""Configuration checks: every refused input before any weight is read, and
every key RAM ignores as stock mergekit ignores it (a warning, then the merge).

The cases live in tests/rejected_inputs.py, one list that drives both the
parametrized test below and the docs/errors.md table of their messages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
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
)

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


def test_weight_spy_catches_reads(family_f32, tmp_path):
    """The guard the config-stage cases run under does see a checkpoint read."""
    config = config_of(family_f32.config_dict("ramplus"))
    with no_weight_reads(), pytest.raises(AssertionError, match="checkpoint"):
        mergekit_ram.run_merge(config, str(tmp_path / "out"), MergeOptions(quiet=True))


def test_python_api_refuses_before_reading(family_f32, tmp_path):
    config = config_of(family_f32.config_dict("ramplus", parameters={"r": -1}))
    with no_weight_reads(), pytest.raises(ValueError, match="parameters.r"):
        mergekit_ram.run_merge(config, str(tmp_path / "out"), MergeOptions(quiet=True))
    assert not (tmp_path / "out").exists()


def mergekit_yaml(config: Path, out: Path, plugin: bool = True):
    """A `mergekit-yaml` process, with the plugin's autoload on or off."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env["MERGEKIT_RAM_AUTOLOAD"] = "1" if plugin else "0"
    command = [str(BIN / "mergekit-yaml"), str(config), str(out), "--quiet"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def test_stock_mergekit_yaml_refuses_a_key_written_twice(family_f32, tmp_path):
    """mergekit-yaml's safe_load keeps the last `parameters:`; the wrapper
    reads the text it was given again and refuses the repeat."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    mergekit_ram.install()
    path = tmp_path / "twice.yml"
    text = family_f32.yaml("ramplus", parameters={"r": 0.5})
    path.write_text(text + "parameters: {alpha: 1.0}\n")
    with no_weight_reads():
        result = CliRunner().invoke(mergekit_yaml, [str(path), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "the key 'parameters' is written twice" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


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
    paths = {}
    for name, path in family_f32.paths.items():
        (tmp_path / f'{name} "q"').symlink_to(path)
        paths[name] = str(tmp_path / f'{name} "q"')
    document = family_f32.config_dict("ramplus", base_model=paths["base"])
    for entry, name in zip(document["models"], family_f32.tasks):
        entry["model"] = paths[name]
    with no_weight_reads():
        assert not check_config(config_of(document)).warnings


def test_slices_with_the_base_pass(family_f32):
    document = family_f32.config_dict("ramplus", parameters={"r": 0.2})
    del document["models"]
    document["slices"] = [
        {
            "sources": [
                {"model": family_f32.paths[name], "layer_range": [0, 2]}
                for name in ("base", *family_f32.tasks)
            ]
        }
    ]
    check_config(config_of(document))


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


def test_hub_ids_are_left_to_mergekit(family_f32, monkeypatch):
    """A name spelled like a hub id that is no local folder is mergekit's to
    fetch: validation asks nothing of the hub."""
    import huggingface_hub

    def no_network(*_args, **_kwargs):
        raise AssertionError("validation must not look a model up")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setattr(huggingface_hub, "get_session", no_network)
    document = family_f32.config_dict("ramplus", base_model="some-org/some-model")
    check_config(config_of(document))


# Mistakes stock mergekit silently ignored (or met with a traceback): refused
# by `mergekit-yaml` itself too, with the message `mergekit-ram merge` prints.
DROPPED = [
    case
    for case in CASES
    if case.id.split("-")[0] in ("key", "parameter", "two", "method")
    and case.kind == "error"
]


@pytest.mark.parametrize("case", DROPPED, ids=lambda case: case.id)
def test_stock_mergekit_yaml_refuses_the_same_mistakes(case, outcomes, workspace):
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    mergekit_ram.install()
    assert len(DROPPED) == 10
    config = workspace.root / f"{case.id}.yml"  # written by the outcomes run
    out = workspace.root / f"stock-{case.id}"
    previous = os.getcwd()
    os.chdir(workspace.root)
    try:
        with no_weight_reads():
            result = CliRunner().invoke(mergekit_yaml, [str(config), str(out)])
    finally:
        os.chdir(previous)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    printed = placeholders(result.output, workspace).strip()
    assert printed == f"Error: {outcomes[case.id].message}"
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
    plain = tmp_path / "plain.yml"
    plain.write_text(family_f32.yaml("ram"))
    templated = tmp_path / "templated.yml"
    templated.write_text(family_f32.yaml("ram", **TEMPLATES[template]))
    runs = {}
    for path in (plain, templated):
        runs[path.stem] = mergekit_yaml(path, tmp_path / f"out-{path.stem}")
        assert runs[path.stem].returncode == 0, runs[path.stem].stderr
    warned = [
        line
        for line in runs["templated"].stderr.splitlines()
        if line.startswith("WARNING:mergekit_ram:")
    ]
    keys = {
        f"models[{i}].parameters.{key}"
        for i, name in enumerate(family_f32.tasks)
        for key in TEMPLATES[template]["model_parameters"].get(name, {})
    } | {f"parameters.{key}" for key in TEMPLATES[template]["parameters"]}
    assert len(warned) == len(keys), warned
    assert all(
        any(line.split(":", 2)[2].startswith(k) for line in warned) for k in keys
    )
    assert "WARNING:mergekit_ram" not in runs["plain"].stderr
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
        runs[plugin] = mergekit_yaml(config, out, plugin)
        assert runs[plugin].returncode == 0, runs[plugin].stderr
        files[plugin] = {
            p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()
        }
    assert runs[True].stdout == runs[False].stdout
    assert runs[True].stderr == runs[False].stderr
    assert files[True].keys() == files[False].keys() and files[True]
    for name, data in files[True].items():
        if name == Path("README.md"):
            data, other = (sorted(d.splitlines()) for d in (data, files[False][name]))
            assert data == other
        else:
            assert data == files[False][name], name
