"""A copy of the installed mergekit with one change a release might make, and
a driver that merges through every entry point on it.

`host_copy(root, change)` copies mergekit's package under root (put first on
PYTHONPATH, it shadows the installed one) and applies CHANGES[change]: each a
regular expression and its replacement, applied to every module of the copy,
so a name is renamed everywhere mergekit uses it, or a keyword is added where
mergekit defines and where its own caller passes it.

Run as `python changed_host.py ROOT PLUGIN`: merges ROOT/configs.json's
configurations through mergekit-yaml, mergekit-ram merge, both run_merge and
both merge_state_dicts (PLUGIN "0": only stock `linear` through mergekit-yaml)
and prints, per entry point, the exit code, the error and the output's files'
hashes (None: OUT does not exist).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

# change -> [(pattern, replacement)], applied to every module of the copy.
CHANGES: dict[str, list[tuple[str, str]]] = {
    "none": [],
    "MergePlanner._plan renamed": [(r"\b_plan\b", "_plan_v2")],
    "MergePlanner._tensors renamed": [(r"\b_tensors\b", "_planned")],
    "plan_to_disk gains a keyword its caller passes": [
        (
            r"def plan_to_disk\(self, out_path: str\)",
            "def plan_to_disk(self, out_path: str, trace: bool = False)",
        ),
        (
            r"\.plan_to_disk\(out_path=out_path\)",
            ".plan_to_disk(out_path=out_path, trace=True)",
        ),
    ],
    "run_merge gains a keyword its caller passes": [
        (
            r"(def run_merge\(.*?config_source: Optional\[str\] = None,)",
            r"\1\n    trace: bool = False,",
        ),
        (
            r"(\n        config_source=config_source,\n    \))",
            "\n        config_source=config_source,\n        trace=True,\n    )",
        ),
    ],
    "generate_card(config_yaml=) renamed": [(r"\bconfig_yaml\b", "recipe_yaml")],
    "card.is_hf renamed": [(r"\bis_hf\b", "is_hub_repo")],
    "registry._METHODS renamed": [(r"\b_METHODS\b", "_REGISTRY")],
    "ram.ram_merge renamed": [(r"\bram_merge\b", "ram_method")],
    "GroupMergeMethod._execute renamed": [(r"\b_execute\b", "_run_groups")],
    "easy_define._parameter_spec renamed": [(r"\b_parameter_spec\b", "_spec_of")],
    "dtype.align_dtype renamed": [(r"\balign_dtype\b", "to_dtype")],
    "conversion._iter_transform_matches renamed": [
        (r"\b_iter_transform_matches\b", "_matches")
    ],
    "LoadTensor._resolve_name renamed": [(r"\b_resolve_name\b", "_stored_name")],
    "Executor.schedule renamed": [(r"self\.schedule\b", "self.order")],
    "ExecuteMergeMethodTask.input_parameters renamed": [
        (r"\binput_parameters\b", "per_input")
    ],
}
# What a merge that asks for ram / ramplus does on each: merged as on the
# unchanged host ("same"), or refused with the contract's message.
SAME = {"none", "generate_card(config_yaml=) renamed", "registry._METHODS renamed"}
SAME |= {"ram.ram_merge renamed", "plan_to_disk gains a keyword its caller passes"}
SAME |= {"run_merge gains a keyword its caller passes"}
SAME |= {"conversion._iter_transform_matches renamed"}  # no longer relied on
REFUSED = "cannot install into mergekit"


def host_copy(root: Path, change: str) -> Path:
    """A folder holding a copy of mergekit with `change` made (every pattern
    must change something, or the test would test nothing)."""
    installed = Path(importlib.util.find_spec("mergekit").origin).parent
    copy = root / "mergekit"
    shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for pattern, replacement in CHANGES[change]:
        hits = 0
        for module in copy.rglob("*.py"):
            text = module.read_text(encoding="utf-8")
            new, count = re.subn(pattern, replacement, text, flags=re.S)
            module.write_text(new, encoding="utf-8")
            hits += count
        assert hits, f"{change}: {pattern!r} matched nothing"
    return root


def _files(out: Path) -> dict[str, str] | None:
    """Each file's hash (None: OUT does not exist); not our manifest (it holds
    mtimes), ram_statistics.json without its timing, the card's lines sorted
    (mergekit lists models in a set's order, and on Python 3.11 hash(None)
    differs from process to process)."""
    if not out.exists():
        return None
    found = {}
    for path in sorted(p for p in out.rglob("*") if ".mergekit-ram" not in p.parts):
        data = path.read_bytes() if path.is_file() else None
        if path.name == "ram_statistics.json":
            data = json.dumps({**json.loads(data), "seconds": None}).encode()
        if path.name == "README.md":
            data = b"\n".join(sorted(data.splitlines()))
        if data is not None:
            found[str(path.relative_to(out))] = hashlib.sha256(data).hexdigest()
    return found


def _run(out: Path, call) -> dict:
    error, code = None, 0
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            call(str(out))
    except SystemExit as exit_:  # a click command; its error is its last line
        code = exit_.code
        error = (stderr.getvalue().strip().splitlines() or [None])[-1] if code else None
    except Exception as exception:
        code, error = None, f"{type(exception).__name__}: {exception}"
    return {"code": code, "error": error, "files": _files(out)}


def entry_points(configs: dict[str, str], plugin: bool) -> dict:
    """label -> a function of OUT that merges there."""
    import yaml

    def cli(module: str, *args: str):
        def call(out: str) -> None:
            main = importlib.import_module(module).main
            main([*args, out], standalone_mode=True)
            raise SystemExit(0)

        return call

    def api(run_merge: str, name: str):
        def call(out: str) -> None:
            from mergekit.config import MergeConfiguration
            from mergekit.options import MergeOptions

            text = Path(configs[name]).read_text(encoding="utf-8")
            config = MergeConfiguration.model_validate(yaml.safe_load(text))
            module, _, function = run_merge.rpartition(".")
            merge = getattr(importlib.import_module(module), function)
            merge(config, out, MergeOptions(quiet=True))

        return call

    def state_dicts(module: str):
        from safetensors.torch import load_file, save_file

        config = yaml.safe_load(Path(configs["ramplus"]).read_text(encoding="utf-8"))
        paths = [config["base_model"]] + [m["model"] for m in config["models"]]

        def call(out: str) -> None:
            merge = importlib.import_module(module).merge_state_dicts
            models = {p: load_file(os.path.join(p, "model.safetensors")) for p in paths}
            params = config.get("parameters", {})
            merged = merge(models, "ramplus", base=paths[0], parameters=params)
            os.makedirs(out)
            save_file(merged, os.path.join(out, "model.safetensors"))

        return call

    runs = {"mergekit-yaml linear": cli("mergekit.scripts.run_yaml", configs["linear"])}
    if not plugin:
        return runs
    for name in ("ram", "ramplus", "ramplus tensor"):
        runs[f"mergekit-yaml {name}"] = cli("mergekit.scripts.run_yaml", configs[name])
    runs["mergekit-ram merge ramplus"] = cli(
        "mergekit_ram.commands.cli", "merge", configs["ramplus"]
    )
    runs["mergekit.merge.run_merge ram"] = api("mergekit.merge.run_merge", "ram")
    runs["mergekit_ram.run_merge ramplus"] = api("mergekit_ram.run_merge", "ramplus")
    runs["mergekit merge_state_dicts ramplus"] = state_dicts("mergekit.merge_methods")
    runs["mergekit_ram merge_state_dicts ramplus"] = state_dicts("mergekit_ram")
    return runs


if __name__ == "__main__":
    root, plugin = Path(sys.argv[1]), sys.argv[2] == "1"
    configs = json.loads((root / "configs.json").read_text(encoding="utf-8"))
    outs = root / ("with" if plugin else "without")
    results = {
        label: _run(outs / label.replace(" ", "_"), call)
        for label, call in entry_points(configs, plugin).items()
    }
    print(json.dumps(results))
