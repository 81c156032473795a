"""The package's layers, read from every import statement (lazy ones too):
core (the paper's math: torch and the standard library, no file) <-
integration (mergekit) <- analysis <- commands; and importing the package
loads no mergekit, so `mergekit-ram --help` stays instant."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mergekit_ram"
LAYERS = {"core": 0, "integration": 1, "analysis": 2, "commands": 3, "__main__": 3}
NOT_IN_CORE = {"mergekit", "click", "transformers", "yaml", "safetensors", "os"}
NOT_IN_CORE |= {"huggingface_hub", "pathlib", "shutil", "io", "stat", "tempfile"}


def test_arrows_only_point_down_and_core_is_math():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        here = LAYERS[parts[0]]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: a relative import"
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                top, *rest = name.split(".")
                there = LAYERS.get(rest[0], 0) if top == "mergekit_ram" and rest else 0
                if there > here or here == 0 and top in NOT_IN_CORE:
                    wrong.append(f"{'.'.join(parts)} imports {name}")
    assert wrong == []


def test_importing_the_package_loads_no_mergekit():
    heavy = ("mergekit.", "click", "transformers", "safetensors", "yaml")
    code = (
        "import sys, mergekit_ram; print([m for m in sys.modules if m.startswith(%r)])"
    )
    code %= (heavy,)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"
