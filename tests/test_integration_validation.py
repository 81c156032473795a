"""Configuration checks: every refused input, before any weight is read.

The refused inputs live in tests/rejected_inputs.py, one list that drives
both the parametrized test below and the docs/errors.md table of their messages.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from huggingface_hub import constants
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
from mergekit_ram.core.settings import MergeSettings
from mergekit_ram.integration import model_locations
from mergekit_ram.integration.validation import validate_analysis, validate_config

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
def test_refused_with_exit_2_and_a_message(case, outcomes, workspace):
    outcome = outcomes[case.id]
    assert outcome.exit_code == 2, outcome.output
    assert "Traceback" not in outcome.output
    assert outcome.message, outcome.output
    for fragment in case.expect:
        assert fragment in outcome.message, outcome.message
    out = workspace.root / f"out-{case.id}"
    if case.stage == "config":
        assert not out.exists()
    else:  # a merge that failed leaves nothing behind
        assert not out.exists() or not any(out.iterdir())


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


def test_stock_mergekit_yaml_exits_2_without_traceback(family_f32, tmp_path):
    """Stock mergekit-yaml validates too (the autoload hook wraps run_merge),
    and a RAMInputError raised inside mergekit's run_merge reaches click."""
    path = tmp_path / "negative.yml"
    path.write_text(family_f32.yaml("ramplus", parameters={"r": -1}))
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_RAM_AUTOLOAD"}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [str(BIN / "mergekit-yaml"), str(path), str(tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "Error: parameters.r: -1 is negative" in done.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


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


def test_plan_time_check_is_a_ram_input_error():
    """The planner's backstop raises the same message as config time."""
    values = dict(epsilon=1e-5, r=0.1, alpha=2.0, saturation="clip")
    per_tensor = [
        ("a", {**values, "statistics": "global"}),
        ("b", {**values, "statistics": "global", "r": 0.2}),
    ]
    with pytest.raises(RAMInputError) as caught:
        MergeSettings.from_parameters(per_tensor)
    assert caught.value.exit_code == 2
    message = caught.value.message
    assert "'r' is 0.1 for tensor a but 0.2 for b" in message
    gradient = next(c for c in CASES if c.id == "r-gradient-global")
    assert gradient.expect[-1] in message  # same fix, one wording


def test_example_configs_pass(tmp_path, monkeypatch):
    build_models(str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    names = sorted(EXAMPLES.glob("*.yml"))
    assert names
    for path in names:
        config = config_of(yaml.safe_load(path.read_text(encoding="utf-8")))
        with no_weight_reads():
            validate_config(config, MergeOptions())
            validate_analysis(config, MergeOptions())


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
        validate_config(config)
    assert config.model_dump() == before


def test_base_listed_among_the_models_passes(family_f32):
    document = family_f32.config_dict("ramplus", tasks=["base", *family_f32.tasks])
    validate_config(config_of(document))


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
    validate_config(config_of(document))


def test_other_methods_are_left_alone(family_f32, tmp_path):
    document = family_f32.config_dict(
        "ties",
        parameters={"rescale_factor": 1.2},
        base_model=str(tmp_path / "missing"),
    )
    config = config_of(document)
    validate_config(config)
    with pytest.raises(RAMInputError, match="missing does not exist"):
        validate_analysis(config)


def test_hub_ids_are_left_to_mergekit_when_the_hub_answers(family_f32, monkeypatch):
    import huggingface_hub

    def no_network(*_args, **_kwargs):
        raise AssertionError("validation must not look a model up")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_locations, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    document = family_f32.config_dict("ramplus", base_model="some-org/some-model")
    validate_config(config_of(document))


def closed_endpoint() -> str:
    """http://127.0.0.1:PORT where nothing listens: a hub that cannot be reached."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize(
    "repo, expect",
    [
        ("nobody/no-such-model", "not in the local Hugging Face cache either"),
        ("some-org/cached", "Write the cached snapshot's directory instead"),
    ],
    ids=["not cached", "cached"],
)
def test_unreachable_hub_refuses_hub_ids_at_once(
    family_f32, workspace, monkeypatch, repo, expect
):
    """HF_HUB_OFFLINE unset, the hub unreachable: one paragraph, in seconds."""
    endpoint = closed_endpoint()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    workspace.hub_cache("some-org/cached")
    document = family_f32.config_dict("ramplus", base_model=repo)
    options = MergeOptions(transformers_cache=str(workspace.root / "hf"))
    start = time.perf_counter()
    with no_weight_reads(), pytest.raises(RAMInputError) as caught:
        validate_config(config_of(document), options)
    assert time.perf_counter() - start < 5
    message = caught.value.message
    assert message.startswith(f"base_model: {repo} ") and expect in message
    assert f"the hub at {endpoint} did not answer" in message


@pytest.mark.parametrize("command", [["mergekit-ram", "merge"], ["mergekit-yaml"]])
def test_unreachable_hub_is_one_error_paragraph(family_f32, tmp_path, command):
    """Both entry points, with no HF_HUB_OFFLINE, an uncached hub id and a hub
    that refuses connections: exit 2 and one `Error:` paragraph naming the
    model, no traceback and no retries (which took about 40 s)."""
    path = tmp_path / "hub.yml"
    path.write_text(family_f32.yaml("ramplus", base_model="nobody/no-such-model"))
    unset = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MERGEKIT_RAM_AUTOLOAD")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(HF_ENDPOINT=closed_endpoint(), HF_HOME=str(tmp_path / "hf"))
    start = time.perf_counter()
    done = subprocess.run(
        [str(BIN / command[0]), *command[1:], str(path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith("Error: base_model: nobody/no-such-model is not a local")
    assert env["HF_ENDPOINT"] in line
    assert elapsed < 30
    assert not (tmp_path / "out").exists()


# Mistakes stock mergekit silently ignored (or met with a traceback): refused
# by `mergekit-yaml` itself too, with the message `mergekit-ram merge` prints.
DROPPED = [
    case
    for case in CASES
    if case.id.split("-")[0] in ("key", "parameter", "two", "method")
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
