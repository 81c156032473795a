"""benchmarks/speed.py: its pure helpers, and (slow) one tiny end-to-end run."""

from __future__ import annotations

import os
import sys
from math import prod

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import speed  # noqa: E402

TIME_V = """\
\tCommand being timed: "mergekit-yaml c.yml out"
\tUser time (seconds): 12.50
\tSystem time (seconds): 1.25
\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02.50
\tMaximum resident set size (kbytes): 2345678
\tExit status: 0
"""


def test_parse_time_v_reads_wall_rss_user_system():
    run = speed.parse_time_v(TIME_V)
    assert run == speed.Run(wall=62.5, rss=2345678, user=12.5, system=1.25)
    hours = TIME_V.replace("1:02.50", "1:00:01")
    assert speed.parse_time_v(hours).wall == 3601.0


def test_parse_time_v_refuses_output_without_the_fields():
    with pytest.raises(ValueError, match="Maximum resident"):
        speed.parse_time_v(TIME_V.replace("Maximum resident", "Max resident"))


@pytest.mark.parametrize("size", list(speed.SIZES))
def test_parameter_count_matches_the_tensors_built(size):
    total = sum(prod(shape) for _, shape in speed.tensor_shapes(size))
    assert speed.parameter_count(size) == total


def test_named_sizes_are_what_they_say():
    assert 130e6 < speed.parameter_count("135m") < 170e6
    assert speed.parameter_count("1b") >= 1e9


def test_agent_densities_start_with_the_papers_and_stay_below_one():
    assert speed.agent_densities(3) == list(speed.DENSITIES)
    six = speed.agent_densities(6)
    assert six[:3] == list(speed.DENSITIES) and len(set(six)) == 6
    assert all(0 < d < 1 for d in speed.agent_densities(30))


def test_table_reports_ratios_to_stock_ram():
    runs = {
        speed.BASELINE: [speed.Run(10, 1000, 1, 1), speed.Run(12, 3000, 1, 1)],
        "our ram": [speed.Run(5.5, 1000, 1, 1)],
    }
    lines = speed.table(runs)
    assert "| stock ram | 11.0 | 1.00× |" in lines[2]
    assert "| our ram | 5.5 | 0.50× | 0.00 | 0.50× |" in lines[3]


def test_task_arithmetic_config_carries_weights_and_ours_do_not():
    paths = {"base": "/m/base", "a": "/m/a"}
    assert "weight: 1.0" in speed.config_yaml("task_arithmetic", {}, paths)
    assert "weight" not in speed.config_yaml("ramplus", {"statistics": "tensor"}, paths)


@pytest.mark.slow
def test_tiny_benchmark_runs_end_to_end(tmp_path):
    output = tmp_path / "table.md"
    work = tmp_path / "work"
    work.mkdir()
    (work / "out").mkdir()  # a user's folder, which the run must leave alone
    code = speed.main(
        ["--sizes", "tiny", "--rounds", "1", "--workdir", str(work)]
        + ["--output", str(output)]
    )
    assert code == 0
    text = output.read_text()
    for name in speed.METHODS:
        assert f"| {name} |" in text
    assert sorted(p.name for p in work.iterdir()) == ["out", "tiny-3"]
