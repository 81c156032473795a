"""README.md is exactly true where a test can tell: its YAML copies equal the
files they name, its Use commands and Python example run as written from a
folder holding the repository's example configs after the documented demo
step, and its dependency list and licence match pyproject.toml."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from mergekit_ram.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README, re.M | re.S)


def use_section() -> str:
    return README.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]


def fenced(section: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", section, re.M | re.S)


def run_command(line: str) -> None:
    """One line of the README's Use commands, run in-process."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    words = shlex.split(line, comments=True)
    if not words:
        return
    tool, args = words[0], words[1:]
    if tool == "mergekit-yaml":
        mergekit_yaml(args, standalone_mode=False)
    elif tool == "mergekit-ram":
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, f"{line}\n{result.output}"
    else:
        raise AssertionError(f"the Use commands run an unknown tool: {line}")


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """A folder with the repository's example configs, after the README's Use
    commands ran there one by one (the demo step first)."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "example_configs", root / "example_configs")
    (command_block,) = fenced(use_section(), "bash")
    lines = [line for line in command_block.splitlines() if line.strip()]
    assert lines[0].split("#")[0].split() == ["mergekit-ram", "demo", "--out", "."]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for line in lines:
            run_command(line)
    return root


def test_yaml_blocks_equal_the_files_they_name():
    named = 0
    for block in blocks("yaml"):
        first, _, rest = block.partition("\n")
        match = re.fullmatch(r"# (\S+\.ya?ml)", first)
        if match:
            named += 1
            assert rest == (ROOT / match.group(1)).read_text(encoding="utf-8")
    assert named >= 1


def test_use_commands_merge_from_the_root_after_the_demo(repository):
    for name in ("base", "coder", "tool_caller", "memory"):
        assert (repository / "models" / name / "config.json").is_file(), name
    merged = repository / "merged"
    assert (merged / "config.json").is_file()
    written = (merged / "mergekit_config.yml").read_text(encoding="utf-8")
    source = (ROOT / "example_configs" / "ramplus.yml").read_text(encoding="utf-8")
    assert written == source


def test_statistics_example_is_the_demo_coder_row(repository):
    (example,) = [b for b in blocks("json") if '"overlap_histogram"' in b]
    shown = json.loads(example)
    real = json.loads((repository / "merged" / "ram_statistics.json").read_text())
    for key in ("epsilon", "r", "alpha", "saturation", "statistics"):
        assert shown[key] == real[key], key
    assert (shown["num_tensors"], shown["num_elements"]) == (
        real["num_tensors"],
        real["num_elements"],
    )
    (row,) = shown["tasks"]
    first = real["tasks"][0]
    for key in ("model", "elements", "changed", "shared", "unique"):
        assert row[key] == first[key], key
    assert row["overlap_histogram"] == first["overlap_histogram"]
    assert row["rho"] == round(first["rho"], 2)
    assert row["scale"] == first["scale"]


def test_python_example_runs_and_both_merges_agree(repository, monkeypatch):
    (example,) = fenced(use_section(), "python")
    monkeypatch.chdir(repository)
    namespace: dict = {}
    exec(compile(example, "README.md (Use, Python)", "exec"), namespace)
    on_disk = load_file(repository / "merged" / "model.safetensors")
    in_memory = namespace["merged"]
    assert in_memory.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert in_memory[name].dtype == tensor.dtype, name
        assert in_memory[name].equal(tensor), name


def test_dependencies_are_the_ones_listed():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    install = README.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"The package's dependencies are (.*?)\.\n", install, re.S)
    assert listed is not None
    named = re.findall(r"`([^`]+)`", listed.group(1))
    assert named == project["project"]["dependencies"]
    ruff = next(
        r for r in project["project"]["optional-dependencies"]["test"] if "ruff" in r
    )
    assert ruff.startswith("ruff==") and f"ruff {ruff[6:]}" in install


def test_licence_file_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["license"] == "LGPL-3.0-only"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:7] == [
        "GNU",
        "LESSER",
        "GENERAL",
        "PUBLIC",
        "LICENSE",
        "Version",
        "3,",
    ]
    gpl = (ROOT / "COPYING").read_text(encoding="utf-8")
    assert gpl.split()[:6] == ["GNU", "GENERAL", "PUBLIC", "LICENSE", "Version", "3,"]


def test_the_spec_is_cited_where_a_clone_has_it():
    old_name = "RAM_" + "SPEC"
    texts = [ROOT / "README.md", ROOT / "docs" / "report_schema.md"]
    texts += [*ROOT.glob("mergekit_ram/**/*.py"), *ROOT.glob("tests/*.py")]
    texts += [*ROOT.glob("benchmarks/**/*.py"), *ROOT.glob("benchmarks/**/*.md")]
    citing = [str(p.relative_to(ROOT)) for p in texts if old_name in p.read_text()]
    assert citing == []
