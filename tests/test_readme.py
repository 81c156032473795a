"""README.md and the docs/ pages it links are exactly true where a test can tell:
the README's command blocks run in order in a fresh shell (slow) and its Use
commands and Python example run as written after the documented demo step
(in-process, default run); its YAML copies equal the files they name; the
statistics example matches the demo's output; links resolve; the dependency
list matches pyproject.toml."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from mergekit_ram.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += [ROOT / "benchmarks" / "agents" / "README.md"]
# The one README command a test cannot run: it is the command that runs this
# test (CI runs it from .ci/run; test_ci_runs_the_readme_test_command checks).
TEST_COMMAND = "bash scripts/test.sh"


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def use_section() -> str:
    return section(README, "Use")


def run_command(line: str) -> None:
    """One line of the README's Use commands, run in-process (the activation
    line only matters to a shell)."""
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    words = shlex.split(line, comments=True)
    if not words or words[0] == "source":
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


def test_use_commands_merge_from_the_root_after_the_demo(repository):
    for name in ("base", "coder", "tool_caller", "memory"):
        assert (repository / "models" / name / "config.json").is_file(), name
    merged = repository / "merged"
    assert (merged / "config.json").is_file()
    written = (merged / "mergekit_config.yml").read_text(encoding="utf-8")
    source = (ROOT / "example_configs" / "ramplus.yml").read_text(encoding="utf-8")
    assert written == source


def test_use_commands_write_the_analyze_report(repository):
    report = json.loads((repository / "report" / "report.json").read_text())
    assert [t["model"] for t in report["tasks"]] == [
        "./models/coder",
        "./models/tool_caller",
        "./models/memory",
    ]


def test_statistics_example_is_the_demo_coder_row(repository):
    outputs = (ROOT / "docs" / "outputs.md").read_text(encoding="utf-8")
    (example,) = [b for b in fenced(outputs, "json") if '"overlap_histogram"' in b]
    shown = json.loads(example)
    real = json.loads((repository / "merged" / "ram_statistics.json").read_text())
    assert shown.keys() == real.keys()
    for key in ("epsilon", "r", "alpha", "saturation", "statistics", "written_dtypes"):
        assert shown[key] == real[key], key
    assert (shown["num_tensors"], shown["num_elements"]) == (
        real["num_tensors"],
        real["num_elements"],
    )
    (row,) = shown["tasks"]
    first = real["tasks"][0]
    assert row.keys() == first.keys()
    for key in ("model", "elements", "changed", "shared", "unique", "rescaled"):
        assert row[key] == first[key], key
    assert row["rescale_survived"] == first["rescale_survived"]
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
    install = section(README, "Install elsewhere")
    listed = re.search(r"The package's dependencies are (.*?)\.\n", install, re.S)
    assert listed is not None
    named = re.findall(r"`([^`]+)`", listed.group(1))
    assert named == project["project"]["dependencies"]
    ruff = next(
        r for r in project["project"]["optional-dependencies"]["test"] if "ruff" in r
    )
    assert ruff.startswith("ruff==") and f"ruff {ruff[6:]}" in install


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    checked = 0
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links {target}: no such file"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"{page.name}: {target}"
        checked += 1
    assert checked or page.name != "README.md"


def test_ci_runs_the_readme_test_command():
    (two_commands,) = fenced(section(README, "Two commands"), "bash")
    assert TEST_COMMAND in [
        line.split("#")[0].strip() for line in two_commands.splitlines()
    ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(rf"^(\w+=\S+ )*{re.escape(TEST_COMMAND)}\b", ci, re.M)


def readme_script() -> str:
    """Every command block of the README in order, as one shell session: bash
    blocks line by line, Python blocks through the python the session has."""
    parts = ["set -euo pipefail"]
    for language, body in re.findall(
        r"^```(bash|python)\n(.*?)^```$", README, re.M | re.S
    ):
        if language == "python":
            parts.append(f"python - <<'README_PYTHON'\n{body}README_PYTHON")
            continue
        for line in body.splitlines():
            if line.split("#")[0].strip() != TEST_COMMAND:
                parts.append(line)
    return "\n".join(parts) + "\n"


def fresh_checkout(target: Path) -> None:
    """The files a clone of this checkout has (tracked and not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def fresh_shell_environment() -> dict[str, str]:
    """This machine's environment without anything a venv or our tests set."""
    dropped = {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "HF_HUB_OFFLINE", "VENV"}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    venv_bin = str(Path(sys.executable).parent)
    paths = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(p for p in paths if p and p != venv_bin)
    return env


@pytest.mark.slow
def test_every_readme_command_block_runs_in_order_in_a_fresh_shell(tmp_path):
    """A newcomer pasting the README's blocks, in order, into one new shell in a
    fresh clone: set-up, the demo, activation, the Use commands, the Python."""
    checkout = tmp_path / "clone"
    fresh_checkout(checkout)
    result = subprocess.run(
        ["bash", "-c", readme_script()],
        cwd=checkout,
        env=fresh_shell_environment(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "setup: creating .venv" in output
    assert "setup: installing PyTorch" in output
    assert "setup: done" in output
    assert re.search(r"mergekit-ram \d+\.\d+\.\d+", output)
    assert (checkout / "merged" / "ram_statistics.json").is_file()
    assert (checkout / "report" / "report.json").is_file()
