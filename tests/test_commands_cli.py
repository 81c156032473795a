"""`mergekit-ram merge`: mergekit-yaml's options, global RAM+ (click CliRunner)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Collection

import click
import mergekit
import pytest
import reference
import torch
from click.testing import CliRunner
from conftest import read_json
from mergekit.options import MergeOptions, add_merge_options
from safetensors.torch import load_file

from mergekit_ram.commands.cli import COMMANDS, main
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
    """Both show mergekit's options in mergekit's groups; analyze only those
    it uses, and refuses the others. `mergekit-ram --help` lists each
    command's description whole."""
    helps = [CliRunner().invoke(main, [c, "--help"]) for c in ("merge", "analyze")]
    for result in helps:
        assert result.exit_code == 0 and "CONFIG_FILE" in result.output, result.output
        assert "Dangerous Options:" in result.output
        assert "--allow-crimes" in result.output
    merge_help, analyze_help = (result.output for result in helps)
    assert "OUT_PATH" in merge_help
    result = CliRunner().invoke(main, ["--help"])  # each description whole
    flat = " ".join(result.output.split())
    assert result.exit_code == 0 and all(
        " ".join(entry.help.split()) in flat for entry in COMMANDS.values()
    ), result.output
    assert [n for n in mergekit_option_names() if not offers(merge_help, n)] == []
    assert ANALYZE_OPTIONS < set(MergeOptions.model_fields)  # no misspelt field
    dropped = mergekit_option_names(set(MergeOptions.model_fields) - ANALYZE_OPTIONS)
    assert {"--out-shard-size", "--write-model-card", "--random-seed"} <= set(dropped)
    assert [n for n in dropped if offers(analyze_help, n)] == []
    kept = mergekit_option_names(ANALYZE_OPTIONS)
    assert [n for n in kept if not offers(analyze_help, n)] == []
    config = tmp_path / "c.yml"
    config.write_text("merge_method: ramplus\n", encoding="utf-8")
    for option in ("--out-shard-size", "--write-model-card", "--random-seed"):
        result = CliRunner().invoke(main, ["analyze", str(config), option, "1"])
        assert result.exit_code == 2, result.output
        assert f"No such option '{option}'" in result.output


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
    merged = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
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


# --- commands that answer at once ------------------------------------------------

# In a fresh process: what answering imports.
IMPORTS = """
import sys
from mergekit_ram.commands.cli import COMMANDS, main
try:
    main(sys.argv[1:])
except SystemExit as done:
    assert done.code in (0, None), done.code
heavy = [m for m in ("torch", "mergekit", "transformers") if m in sys.modules]
assert not heavy, heavy
"""


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"]])
def test_help_imports_neither_torch_nor_mergekit(args):
    command = [sys.executable, "-c", IMPORTS, *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip(), done.stdout + done.stderr


def test_python_dash_m_version_names_both_packages_and_the_install(monkeypatch, capsys):
    """`python -m mergekit_ram --version` (its __main__, run in-process)."""
    monkeypatch.setattr(sys, "argv", ["mergekit_ram", "--version"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("mergekit_ram", run_name="__main__")
    assert done.value.code == 0
    ours = importlib.metadata.version("mergekit-ram")
    host = importlib.metadata.version("mergekit")
    where = os.path.dirname(mergekit.__file__)
    assert capsys.readouterr().out == (
        f"mergekit-ram {ours}, mergekit {host} ({where}): "
        "mergekit-ram is installed into it\n"
    )


# --- messages a newcomer meets ---------------------------------------------------


REFUSED = {  # what a command is given: what its Error says (exit 2)
    "a missing config": ("merge {tmp}/missing.yml {tmp}/out", ["missing.yml"]),
    **{
        f"--epsilon {value}": (
            f"analyze {{config}} --epsilon {value}",
            ["--epsilon", "Input should be"],
        )
        for value in ("nan", "inf", "-1")  # through the YAML's checks
    },
    "swapped arguments": (
        "merge {tmp}/merged {config}",
        ["'CONFIG_FILE': File '{tmp}/merged' is a directory"],
    ),
    **{  # the weights as the config: named with the command's order
        f"a binary config to {command}": (
            f"{command} {{tmp}}/model.safetensors"
            + " {tmp}/out" * (command == "merge"),
            ["is not a text file", f"mergekit-ram {command} {usage}"],
        )
        for command, usage in (
            ("merge", "CONFIG_FILE OUT_PATH"),
            ("analyze", "CONFIG_FILE [--out DIR]"),
        )
    },
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_mistaken_command_line_is_one_error_touching_nothing(
    case, family_f32, tmp_path
):
    """No traceback; no OUT made, the folder given as the config untouched."""
    args, said = REFUSED[case]
    names = {"tmp": tmp_path, "config": tmp_path / "c.yml"}
    (tmp_path / "c.yml").write_text(family_f32.yaml())
    (tmp_path / "merged").mkdir()
    weights = b"\x08\x00\x00\x00\x00\x00\x00\x00{}\xbd\xff"
    (tmp_path / "model.safetensors").write_bytes(weights)
    result = CliRunner().invoke(main, [a.format(**names) for a in args.split()])
    assert result.exit_code == 2, result.output
    assert [s for s in said if s.format(**names) not in result.output] == []
    assert "Traceback" not in result.output
    assert os.listdir(tmp_path / "merged") == [] and not (tmp_path / "out").exists()


def test_an_empty_r_value_is_refused():
    from mergekit_ram.commands.merge_cli import parse_r_values

    for bad in ("0,,0.1", "0.1,"):
        with pytest.raises(ValueError, match="an empty value"):
            parse_r_values(bad)
