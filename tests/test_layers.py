"""The package's layers: core (the paper's math) -> nothing of ours above it,
integration (mergekit) -> core, analysis (the probe's statistics, verdict,
report and card section) -> both, commands -> all three; no import cycle;
core and the package import no mergekit.

The arrows are read from the source (every import statement, including
those inside functions), so a lazy import cannot hide an upward arrow.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mergekit_ram"
LAYERS = {"core": 0, "integration": 1, "analysis": 2, "commands": 3}
# Third-party packages core must not import: it is torch and the standard library.
NOT_IN_CORE = (
    "mergekit",
    "click",
    "transformers",
    "huggingface_hub",
    "yaml",
    "safetensors",
)
# Nor the file system: reading checkpoints is integration.checkpoints' job.
FILE_SYSTEM = ("os", "pathlib", "shutil", "io", "stat", "tempfile", "glob")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(source: str) -> set[str]:
    """Every module an import statement in `source` names.

    Relative imports are refused: the project writes absolute ones, and the
    arrows below are only as good as this parser.
    """
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import of {node.module}"
            found.add(node.module)
            # `from mergekit_ram.commands import api` imports a module too.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def imports_of(path: Path) -> set[str]:
    return imports_in(path.read_text(encoding="utf-8"))


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {
    name: {i for i in imports_of(path) if i in MODULES and i != name}
    for name, path in MODULES.items()
}


def layer(name: str) -> int | None:
    """0 core, 1 integration, 2 analysis, 3 commands (`python -m
    mergekit_ram` runs a command); None for the top-level package."""
    parts = name.split(".")
    if parts[1:] == ["__main__"]:
        return LAYERS["commands"]
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_module_is_in_a_layer():
    loose = [n for n in MODULES if n != "mergekit_ram" and layer(n) is None]
    assert loose == []


def test_arrows_only_point_down():
    upward = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if layer(name) is not None
        and (layer(target) is None or layer(target) > layer(name))
    ]
    assert upward == []


def test_core_imports_only_torch_and_the_standard_library():
    found = [
        f"{name} imports {imported}"
        for name, path in MODULES.items()
        if layer(name) == 0
        for imported in imports_of(path)
        if imported.split(".")[0] in NOT_IN_CORE
    ]
    assert found == []


def test_core_touches_no_file():
    """core is the math: no file-system module, no built-in open()."""
    found = []
    for name, path in MODULES.items():
        if layer(name) != 0:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [
            f"{name} imports {imported}"
            for imported in imports_in(path.read_text(encoding="utf-8"))
            if imported.split(".")[0] in FILE_SYSTEM
        ]
        found += [
            f"{name} calls open() at line {node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open"
        ]
    assert found == []


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_the_parser_sees_lazy_and_from_imports():
    """What the arrows are read with finds imports inside functions too."""
    found = imports_in("def f():\n    from mergekit_ram.commands import api\n")
    assert "mergekit_ram.commands.api" in found
    assert "torch" in imports_of(PACKAGE / "core" / "kernel.py")


# Imports the package, then each core module, in one fresh interpreter; after
# each import it notes which forbidden packages have been loaded so far.
CHECK = """
import importlib, json, sys
found = {{}}
for module in {modules!r}:
    importlib.import_module(module)
    found[module] = sorted(m for m in {forbidden!r} if m in sys.modules)
print(json.dumps(found))
"""


def test_core_and_the_package_load_no_mergekit_in_a_fresh_interpreter():
    """The start-up hook is on (the default), as for every user."""
    modules = ["mergekit_ram"] + [n for n in MODULES if layer(n) == 0]
    code = CHECK.format(modules=modules, forbidden=NOT_IN_CORE)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(found) == modules
    assert {m: loaded for m, loaded in found.items() if loaded} == {}
