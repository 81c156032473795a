"""`mergekit-ram merge`: mergekit-yaml's options, global RAM+ (click CliRunner)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Collection

import click
import mergekit
import pytest
import reference
import torch
import yaml
from click.testing import CliRunner
from conftest import read_json
from mergekit.options import MergeOptions, add_merge_options
from safetensors.torch import load_file

from mergekit_ram.commands.cli import main
from mergekit_ram.commands.merge_cli import ANALYZE_OPTIONS


def mergekit_option_names(fields: Collection[str] | None = None) -> list[str]:
    """Every option string mergekit's own add_merge_options defines (for the
    MergeOptions `fields` only, when given)."""

    @click.command()
    @add_merge_options
    def probe(merge_options):  # pragma: no cover - never invoked
        del merge_options

    names = []
    for param in probe.params:
        if fields is None or param.name in fields:
            names += [*param.opts, *param.secondary_opts]
    return [n for n in names if n.startswith("-")]


def offers(help_text: str, option: str) -> bool:
    """Whether `option` appears in `help_text` as a whole option string."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text) is not None


def test_merge_offers_mergekits_options_and_analyze_those_it_uses(tmp_path):
    merge_help = CliRunner().invoke(main, ["merge", "--help"]).output
    assert "CONFIG_FILE" in merge_help and "OUT_PATH" in merge_help
    assert [n for n in mergekit_option_names() if not offers(merge_help, n)] == []
    assert ANALYZE_OPTIONS < set(MergeOptions.model_fields)  # no misspelt field
    dropped = mergekit_option_names(set(MergeOptions.model_fields) - ANALYZE_OPTIONS)
    assert {"--out-shard-size", "--write-model-card", "--random-seed"} <= set(dropped)
    result = CliRunner().invoke(main, ["analyze", "--help"])
    assert result.exit_code == 0, result.output
    assert [n for n in dropped if offers(result.output, n)] == []
    kept = mergekit_option_names(ANALYZE_OPTIONS)
    assert [n for n in kept if not offers(result.output, n)] == []
    config = tmp_path / "c.yml"
    config.write_text("merge_method: ramplus\n", encoding="utf-8")
    for option in ("--out-shard-size", "--write-model-card", "--random-seed"):
        result = CliRunner().invoke(main, ["analyze", str(config), option, "1"])
        assert result.exit_code == 2, result.output
        assert f"No such option '{option}'" in result.output


def load_merged(out) -> dict[str, torch.Tensor]:
    index = out / "model.safetensors.index.json"
    if not index.exists():
        return load_file(str(out / "model.safetensors"))
    files = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    state = {}
    for name in files:
        state.update(load_file(str(out / name)))
    return state


@pytest.mark.parametrize("shard", [None, "8K"])
def test_merge_yaml(shard, family_f32, tmp_path):
    family = family_f32
    settings = dict(r=0.2, alpha=1.5, saturation="clip")
    config = tmp_path / "ramplus.yml"
    text = "# RAM+ of three agents\n" + family.yaml("ramplus", parameters=settings)
    config.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    args = ["merge", str(config), str(out), "--quiet"]
    if shard is not None:
        args += ["--out-shard-size", shard]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

    base = family.state("base")
    expected, lambdas = reference.merge(base, family.task_states(), **settings)
    merged = load_merged(out)
    assert sorted(merged) == sorted(expected)
    for name in expected:
        assert torch.equal(merged[name], expected[name]), name
    # mergekit's own option reached the writer: small shards, several files.
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (shard is not None)

    assert (out / "mergekit_config.yml").read_text(encoding="utf-8") == text
    doc = read_json(out / "ram_statistics.json")
    assert doc["r"] == settings["r"] and doc["alpha"] == settings["alpha"]
    scales = {row["model"]: row["scale"] for row in doc["tasks"]}
    for t, name in enumerate(family.tasks):
        assert scales[family.paths[name]] == pytest.approx(lambdas[t], rel=1e-12)


def test_merge_refuses_missing_config(tmp_path):
    result = CliRunner().invoke(
        main, ["merge", str(tmp_path / "missing.yml"), str(tmp_path / "out")]
    )
    assert result.exit_code != 0
    assert "missing.yml" in result.output
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def sanity_family(model_family):
    return model_family("sanity", seed=61)


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_analyze_epsilon_passes_the_yaml_checks(sanity_family, tmp_path, value):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(sanity_family.config_dict("ramplus")))
    result = CliRunner().invoke(main, ["analyze", str(path), "--epsilon", value])
    assert result.exit_code == 2, result.output
    assert "--epsilon" in result.output and "Input should be" in result.output


# --- commands that answer at once (issue 29 item 3) ------------------------------

IMPORTS = """
import sys
from mergekit_ram.commands.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    code = done.code
heavy = sorted(m for m in ("torch", "mergekit", "transformers") if m in sys.modules)
print("HEAVY", ",".join(heavy), code)
"""


def run_cli(*args: str) -> tuple[str, list[str]]:
    """Output and the heavy modules imported, of one fresh `mergekit-ram` process."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output, last = done.stdout.rsplit("HEAVY", 1)
    heavy, code = last.split()[:-1], last.split()[-1]
    assert code in ("0", "None"), done.stdout + done.stderr
    return output, [m for m in ",".join(heavy).split(",") if m]


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"]])
def test_help_imports_neither_torch_nor_mergekit(args):
    output, heavy = run_cli(*args)
    assert output.strip() and heavy == []


@pytest.mark.parametrize("command", ["merge", "analyze"])
def test_command_help_is_mergekits_grouped_options(command):
    """`merge --help` imports mergekit (its options are mergekit's) and shows
    them in mergekit's groups."""
    output, heavy = run_cli(command, "--help")
    assert "mergekit" in heavy and "CONFIG_FILE" in output
    assert "Dangerous Options:" in output and "--allow-crimes" in output


def test_top_level_help_shows_each_description_whole():
    from mergekit_ram.commands.cli import COMMANDS

    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    for entry in COMMANDS.values():
        assert " ".join(entry.help.split()) in flat


def test_python_dash_m_version_names_both_packages_and_the_install():
    done = subprocess.run(
        [sys.executable, "-m", "mergekit_ram", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    ours = importlib.metadata.version("mergekit-ram")
    host = importlib.metadata.version("mergekit")
    where = os.path.dirname(mergekit.__file__)
    assert done.stdout == (
        f"mergekit-ram {ours}, mergekit {host} ({where}): "
        "mergekit-ram is installed into it\n"
    )


# --- messages a newcomer meets (issue 30 items 3 and 5) ---------------------------


def test_swapped_arguments_leave_the_folder_alone(sanity_family, tmp_path):
    config = tmp_path / "c.yml"
    config.write_text(yaml.safe_dump(sanity_family.config_dict("ramplus")))
    merged = tmp_path / "merged"
    merged.mkdir()
    result = CliRunner().invoke(main, ["merge", str(merged), str(config)])
    assert result.exit_code == 2, result.output
    assert f"'CONFIG_FILE': File '{merged}' is a directory" in result.output
    assert "Traceback" not in result.output and os.listdir(merged) == []


@pytest.mark.parametrize(
    "command, usage",
    [("merge", "CONFIG_FILE OUT_PATH"), ("analyze", "CONFIG_FILE [--out DIR]")],
)
def test_a_binary_config_file_is_named_with_the_commands_order(
    command, usage, tmp_path
):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}\xbd\xff")
    args = [command, str(weights)] + [str(tmp_path / "out")] * (command == "merge")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "is not a text file" in result.output and "Traceback" not in result.output
    assert f"mergekit-ram {command} {usage}" in result.output
    assert not (tmp_path / "out").exists()


def test_an_empty_r_value_is_refused():
    from mergekit_ram.commands.merge_cli import parse_r_values

    for bad in ("0,,0.1", "0.1,"):
        with pytest.raises(ValueError, match="an empty value"):
            parse_r_values(bad)
