"""README.md and the docs are exactly true where a test can tell: the README's
Use commands and Python example run as written after the documented demo step
(in-process), and so does every shipped example config, as its comment says;
YAML copies equal the files they name; the statistics example matches the
demo's output; the dependency list matches pyproject.toml; CI runs the
README's test command."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from conftest import read_json
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from safetensors.torch import load_file

import mergekit_ram
from mergekit_ram.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += [ROOT / "benchmarks" / "agents" / "README.md"]


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def run_command(line: str) -> None:
    """One line of the README's Use commands, run in-process (the activation
    line only matters to a shell)."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    tool, *args = shlex.split(line, comments=True) or ["source"]
    if tool == "mergekit-yaml":
        mergekit_yaml(args, standalone_mode=False)
    elif tool != "source":
        assert tool == "mergekit-ram", f"the Use commands run an unknown tool: {line}"
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, f"{line}\n{result.output}"


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """A folder with the repository's example configs, after the README's Use
    commands ran there one by one (the demo step first)."""
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "example_configs", root / "example_configs")
    (command_block,) = fenced(section(README, "Use"), "bash")
    lines = [line for line in command_block.splitlines() if line.strip()]
    assert lines[0].split("#")[0].split() == ["source", ".venv/bin/activate"]
    assert lines[1].split("#")[0].split() == ["mergekit-ram", "demo", "--out", "."]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        for line in lines:
            run_command(line)
    return root


def test_yaml_blocks_equal_the_files_they_name():
    named = 0
    for block in [b for page in PAGES for b in fenced(page.read_text(), "yaml")]:
        first, _, rest = block.partition("\n")
        match = re.fullmatch(r"# (\S+\.ya?ml)", first)
        if match:
            named += 1
            assert rest == (ROOT / match.group(1)).read_text(encoding="utf-8")
    assert named >= 1


def test_use_commands_merge_and_report_from_the_root_after_the_demo(repository):
    for name in ("base", "coder", "tool_caller", "memory"):
        assert (repository / "models" / name / "config.json").is_file(), name
    assert (repository / "merged" / "config.json").is_file()
    written = (repository / "merged" / "mergekit_config.yml").read_text()
    assert written == (ROOT / "example_configs" / "ramplus.yml").read_text()
    report = json.loads((repository / "report" / "report.json").read_text())
    models = ["./models/coder", "./models/tool_caller", "./models/memory"]
    assert [t["model"] for t in report["tasks"]] == models


def test_statistics_example_is_the_demo_coder_row(repository):
    outputs = (ROOT / "docs" / "outputs.md").read_text(encoding="utf-8")
    (example,) = [b for b in fenced(outputs, "json") if '"overlap_histogram"' in b]
    shown = json.loads(example)
    real = json.loads((repository / "merged" / "ram_statistics.json").read_text())
    assert shown.keys() == real.keys()
    for key in shown.keys() - {"seconds", "tasks"}:
        assert shown[key] == real[key], key
    (row,) = shown["tasks"]
    first = real["tasks"][0]
    assert row.keys() == first.keys()
    for key in row.keys() - {"rho"}:
        assert row[key] == first[key], key
    assert row["rho"] == round(first["rho"], 2)


def test_python_example_runs_and_both_merges_agree(repository, monkeypatch):
    (example,) = fenced(section(README, "Use"), "python")
    monkeypatch.chdir(repository)
    namespace: dict = {}
    exec(compile(example, "README.md (Use, Python)", "exec"), namespace)
    on_disk = load_file(repository / "merged" / "model.safetensors")
    in_memory = namespace["merged"]
    assert in_memory.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert in_memory[name].dtype == tensor.dtype, name
        assert in_memory[name].equal(tensor), name


def test_the_pinned_ruff_is_the_one_named():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    install = section(README, "Install elsewhere")
    (ruff,) = [r for r in project["optional-dependencies"]["test"] if "ruff" in r]
    assert ruff.startswith("ruff==") and f"ruff {ruff[6:]}" in install


def test_ci_runs_the_readme_test_command():
    (two_commands,) = fenced(section(README, "Two commands"), "bash")
    test = "bash scripts/test.sh"
    assert test in [line.split("#")[0].strip() for line in two_commands.splitlines()]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(rf"^(\w+=\S+ )*{re.escape(test)}\b", ci, re.M)


# --- example_configs/ -----------------------------------------------------------

EXAMPLES = ROOT / "example_configs"
GLOBAL = {"ramplus": (0.1, 2.0), "ramplus_arm_r_v2": (0.2, 1.0)}  # r, alpha
NO_PASS = ["ram", "ram_ties", "ram_unique", "ramplus_tensor_local"]
NO_PASS += ["ramplus_explicit_scale"]


def test_every_example_merges_the_demo_models_as_its_comment_says(
    repository, monkeypatch
):
    """Run where the demo wrote its models, each example writes its recipe as
    given; only the global ones run a statistics pass, with their rule. The
    explicit scales are ramplus.yml's computed ones, copied exactly, so that
    merge writes the same weights without a pass."""
    monkeypatch.chdir(repository)
    names = sorted(p.stem for p in EXAMPLES.glob("*.yml"))
    assert names == sorted([*NO_PASS, *GLOBAL])  # the documented modes
    for name in names:
        source = (EXAMPLES / f"{name}.yml").read_text()
        config = MergeConfiguration.model_validate(yaml.safe_load(source))
        out = repository / f"out-{name}"
        mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True), source)
        assert (out / "config.json").exists()
        assert (out / "mergekit_config.yml").read_text() == source
        assert (out / "ram_statistics.json").exists() == (name in GLOBAL), name
    for name, (r, cap) in GLOBAL.items():
        document = read_json(repository / f"out-{name}/ram_statistics.json")
        rule = (document["r"], document["alpha"], document["saturation"])
        assert rule == (r, cap, "clip")
        for task in document["tasks"]:
            rho = task["shared"] / task["unique"]
            assert task["scale"] == pytest.approx(1 + r * min(rho, cap), rel=1e-12)
        if name == "ramplus":
            example = yaml.safe_load((EXAMPLES / f"{NO_PASS[-1]}.yml").read_text())
            written = [m["parameters"]["unique_scale"] for m in example["models"]]
            assert written == [task["scale"] for task in document["tasks"]]
    computed = load_file(repository / "out-ramplus/model.safetensors")
    explicit = load_file(repository / f"out-{NO_PASS[-1]}/model.safetensors")
    assert computed.keys() == explicit.keys()
    for name, tensor in computed.items():
        assert explicit[name].dtype == tensor.dtype and explicit[name].equal(tensor)
