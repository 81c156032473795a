"""benchmarks/speed.py and benchmarks/account.py (not the package): one tiny
smoke run each (slow), so that the scripts the docs' numbers come from still
run: speed.py writes every method's row and the floor's; account.py's stages
add up to the whole process's wall, the statistics pass in global RAM+ only."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import account  # noqa: E402
import speed  # noqa: E402


@pytest.mark.slow
def test_tiny_benchmark_runs_end_to_end(tmp_path):
    table = tmp_path / "table.md"
    options = ["--rounds", "1", "--workdir", str(tmp_path), "--output", str(table)]
    assert speed.main(["--sizes", "tiny", *options]) == 0
    assert all(
        f"| {name} |" in table.read_text() for name in [*speed.METHODS, speed.FLOOR]
    )


@pytest.mark.slow
def test_stages_add_up_and_only_global_ramplus_counts(tmp_path):
    paths = speed.build_models("tiny", 3, str(tmp_path))
    runs = {}
    for name, method, parameters in (
        ("ram", "ram", {}),
        ("global", "ramplus", {}),
        ("tensor", "ramplus", {"statistics": "tensor"}),
    ):
        config = tmp_path / f"{name}.yml"
        config.write_text(speed.config_yaml(method, parameters, paths))
        runs[name] = account.account(str(config), str(tmp_path / "out"), [])
    stages = [row for row, _ in account.ROWS]
    for seconds in runs.values():
        assert set(seconds) == {*stages, "wall"}
        assert math.isclose(sum(seconds[s] for s in stages), seconds["wall"])
        assert seconds["merge: kernel"] > 0 and seconds["imports: mergekit"] > 0
    assert runs["global"]["pass: count"] > 0
    for name in ("ram", "tensor"):
        assert runs[name]["pass: count"] == runs[name]["pass: read"] == 0
    assert not (tmp_path / "out").exists()
