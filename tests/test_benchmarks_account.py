"""benchmarks/account.py on a tiny model (slow): the stages add up to the
whole process's wall, and only global RAM+ runs the statistics pass."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import account  # noqa: E402
import speed  # noqa: E402


@pytest.mark.slow
def test_stages_add_up_and_only_global_ramplus_counts(tmp_path):
    paths = speed.build_models("tiny", 3, str(tmp_path))
    runs = {}
    for name, parameters in {
        "ram": {},
        "global": {},
        "tensor": {"statistics": "tensor"},
    }.items():
        config = tmp_path / f"{name}.yml"
        method = "ram" if name == "ram" else "ramplus"
        config.write_text(speed.config_yaml(method, parameters, paths))
        runs[name] = account.account(str(config), str(tmp_path / "out"), [])
    for seconds in runs.values():
        stages = [row for row, _ in account.ROWS]
        assert set(seconds) == {*stages, "wall"}
        assert math.isclose(sum(seconds[s] for s in stages), seconds["wall"])
        assert seconds["merge: kernel"] > 0 and seconds["imports: mergekit"] > 0
    assert runs["global"]["pass: count"] > 0
    for name in ("ram", "tensor"):
        assert runs[name]["pass: count"] == runs[name]["pass: read"] == 0
    assert not (tmp_path / "out").exists()
    assert account.table({"ram": [runs["ram"]]})[-1].startswith("| wall | **")
