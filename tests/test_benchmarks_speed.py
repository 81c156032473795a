"""benchmarks/speed.py, one tiny end-to-end run (slow): every method's row
and the floor's, a --compare row from a checkout (this one: the same bytes),
a user's folder in the work folder left alone."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import speed  # noqa: E402


@pytest.mark.slow
def test_tiny_benchmark_runs_end_to_end(tmp_path):
    output = tmp_path / "table.md"
    work = tmp_path / "work"
    work.mkdir()
    (work / "out").mkdir()  # a user's folder, which the run must leave alone
    code = speed.main(
        ["--sizes", "tiny", "--rounds", "1", "--workdir", str(work), "--hash"]
        + ["--compare", f"again={ROOT}", "--compare-methods", "our ram"]
        + ["--output", str(output)]
    )
    assert code == 0
    text = output.read_text()
    for name in [*speed.METHODS, speed.FLOOR, "our ram [again]"]:
        assert f"| {name} |" in text
    digests = dict(
        re.findall(r"^\| (our ram(?: \[again\])?) \|.*`(\w+)` \|$", text, re.M)
    )
    assert len(digests) == 2 and len(set(digests.values())) == 1, text
    assert sorted(p.name for p in work.iterdir()) == ["out", "tiny-3"]
    assert os.listdir(work / "out") == []
