"""The start-up hook: plain mergekit sees `ram`/`ramplus` in fresh interpreters.

Every check that depends on interpreter start-up runs in a subprocess of this
venv's Python (or its console scripts). The slow ones (each imports torch and
mergekit) are started together once per module and awaited by the tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest
import yaml
from conftest import read_json
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram

BIN = Path(sys.executable).parent
OURS = "mergekit_ram.integration.methods.RAMMerge"
TIMEOUT = 300


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MERGEKIT_RAM_AUTOLOAD"}
    env.update(HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


# Prints what a fresh interpreter ended up with, as JSON on the last line.
REPORT = """
import json, sys
from mergekit import merge_methods
def state():
    plan, merge = (sys.modules.get("mergekit." + m) for m in ("plan", "merge"))
    out = {}
    for name in ("ram", "ramplus"):
        method = type(merge_methods.get(name))  # ours: routed, installing first
        out[name] = method.__module__ + "." + method.__name__
    names = ("_plan", "plan_to_disk") if plan else ()
    ours = [hasattr(getattr(plan.MergePlanner, f), "__mergekit_ram__") for f in names]
    out["planner"] = bool(ours) and all(ours)
    out["card"] = hasattr(getattr(merge, "generate_card", None), "__mergekit_ram__")
    return out
first = state()
import mergekit.merge, mergekit.plan
print(json.dumps({"first": first, "final": state()}))
"""

# Which module a fresh interpreter imports first.
ORDERS = {
    name: f"import mergekit.{name}" for name in ("merge_methods", "plan", "merge")
}
ORDERS["mergekit_ram"] = "import mergekit_ram"

AUTOLOAD_OFF = """
import json, sys
from mergekit.merge_methods import get
from mergekit.merge_methods.ram import ram_merge
from mergekit.plan import MergePlanner
try:
    ramplus = get("ramplus") and "registered"
except RuntimeError as error:
    ramplus = "RuntimeError: " + str(error)
patched = hasattr(MergePlanner._plan, "__mergekit_ram__")
imported = "mergekit_ram" in sys.modules
print(json.dumps([ramplus, get("ram") is ram_merge, patched, imported]))
"""


class Launched(dict):
    """Subprocesses started together, by name; `result(name)` waits for one."""

    def result(self, name: str) -> tuple[int, str, str]:
        proc = self[name]
        if not hasattr(proc, "output"):
            proc.output = proc.communicate(timeout=TIMEOUT)
        return (proc.returncode, *proc.output)

    def json(self, name: str) -> dict:
        code, out, err = self.result(name)
        assert code == 0, err
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cli_family(model_family):
    return model_family("cli", seed=11)


@pytest.fixture(scope="module")
def launched(cli_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("autoload")
    config = root / "ramplus.yml"
    config.write_text(cli_family.yaml("ramplus", parameters={"r": 0.3, "alpha": 1.0}))
    runs = Launched()
    commands = {
        tool: [str(BIN / tool), *args, str(config), str(root / tool)]
        for tool, args in (("mergekit-yaml", []), ("mergekit-ram", ["merge"]))
    }
    for name, imports in ORDERS.items():
        commands[name] = [sys.executable, "-c", imports + "\n" + REPORT]
    commands["off"] = [sys.executable, "-c", AUTOLOAD_OFF]
    for name, args in commands.items():
        env = child_env(MERGEKIT_RAM_AUTOLOAD="0") if name == "off" else child_env()
        pipes = dict(stdout=PIPE, stderr=PIPE)
        runs[name] = subprocess.Popen(args, cwd=root, env=env, text=True, **pipes)
    runs.root, runs.config = root, config
    yield runs
    for proc in runs.values():
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_three_entry_points_byte_identical(launched, tmp_path):
    """Plain mergekit-yaml merges RAM+ (statistics, card, the user's recipe),
    byte for byte as mergekit-ram merge and run_merge do."""
    text = launched.config.read_text(encoding="utf-8")
    out = tmp_path / "python"
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True))
    ours = read_json(out / "ram_statistics.json")
    ours.pop("seconds")
    assert ours["r"] == 0.3 and ours["alpha"] == 1.0
    assert all(row["scale"] > 1 for row in ours["tasks"])
    for tool in ("mergekit-yaml", "mergekit-ram"):
        code, _, err = launched.result(tool)
        assert code == 0, f"{tool}: {err}"
        made = launched.root / tool
        weights = (made / "model.safetensors").read_bytes()
        assert weights == (out / "model.safetensors").read_bytes(), tool
        doc = read_json(made / "ram_statistics.json")
        assert doc.pop("seconds") >= 0 and doc == ours, tool
        assert "### RAM+ statistics" in (made / "README.md").read_text("utf-8")
        assert (made / "mergekit_config.yml").read_text("utf-8") == text, tool


@pytest.mark.slow
def test_autoload_off_leaves_stock_mergekit(launched):
    """ramplus unknown, ram stock's, nothing patched, mergekit_ram not imported."""
    ramplus, *state = launched.json("off")
    assert ramplus.startswith("RuntimeError") and state == [True, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("order", sorted(ORDERS))
def test_import_orders_end_registered_and_patched(launched, order):
    state = launched.json(order)
    for when in ("first", "final"):
        assert state[when]["ram"] == state[when]["ramplus"] == OURS, when
    assert state["final"]["planner"] is True and state["final"]["card"] is True
    if order in ("plan", "merge"):
        # mergekit.plan was imported by the order itself: patched at once.
        assert state["first"]["planner"] is True


def test_hook_is_lazy_and_starts_in_below_50ms(tmp_path):
    """At start-up the hook (this project's) is loaded, mergekit, torch and
    mergekit_ram not; `-X importtime`: its cumulative import time, the best
    of several starts, so a busy machine cannot make it flaky."""
    import _mergekit_ram_autoload

    code = "import sys, json; print(json.dumps([m in sys.modules for m in "
    code += "('mergekit', 'torch', 'mergekit_ram')] + "
    code += "[sys.modules['_mergekit_ram_autoload'].__file__]))"
    cumulative = r"import time:\s+\d+\s+\|\s+(\d+)\s+\|\s+_mergekit_ram_autoload$"
    pattern = re.compile(cumulative)
    timings, command = [], [sys.executable, "-X", "importtime", "-c", code]
    for _ in range(7):
        options = dict(cwd=tmp_path, env=child_env(), timeout=TIMEOUT, check=True)
        done = subprocess.run(command, capture_output=True, text=True, **options)
        *loaded, hook = json.loads(done.stdout)
        assert loaded == [False, False, False]
        assert Path(hook).resolve() == Path(_mergekit_ram_autoload.__file__).resolve()
        lines = [m for line in done.stderr.splitlines() if (m := pattern.search(line))]
        assert len(lines) == 1, done.stderr
        timings.append(int(lines[0].group(1)))
    assert min(timings) < 50_000, timings
