"""benchmarks/count_chunk.py: a tiny run's table, and that it refuses a
setting whose counts differ."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import count_chunk  # noqa: E402

from mergekit_ram.core import counting


def test_table_has_every_setting_and_the_shipped_one_at_one():
    shipped = counting.COUNT_CHUNK
    table = count_chunk.main(
        ["--elements", "5000", "--repeats", "1", "--chunks", "64", "1024"]
    )
    rows = [
        line
        for line in table.splitlines()
        if line.startswith("| chunk") or line.startswith("| whole")
    ]
    names = [row.split("|")[1].strip() for row in rows]
    assert names == [
        "chunk 2^6", "chunk 2^10", "whole tensor",
        f"chunk 2^{shipped.bit_length() - 1} (shipped)",
    ]  # fmt: skip
    assert rows[-1].split("|")[3].strip() == "1.00"
    assert counting.COUNT_CHUNK == shipped  # restored


def test_groups_change_unique_shared_and_unchanged_elements():
    base, tasks = count_chunk.group(20000)
    rows, pairs = counting.tensor_overlaps(base, tasks, count_chunk.EPSILON)
    for t, density in enumerate(count_chunk.DENSITIES):
        # bf16 rounds a few of the deltas away, never adds one
        assert 0.9 * density < pairs[t][t] / 20000 < density + 0.01
        assert rows[t][0] > 0 and rows[t][1] > 0  # unique and shared elements
    changed_by_any = sum(count / (k + 1) for row in rows for k, count in enumerate(row))
    assert 0 < changed_by_any < 20000  # and unchanged elements


def test_a_setting_that_counts_differently_fails(monkeypatch):
    real = counting.tensor_overlaps

    def off_by_one(base, tasks, epsilon):
        rows, pairs = real(base, tasks, epsilon)
        if counting.COUNT_CHUNK == 64:
            rows[0][0] += 1
        return rows, pairs

    monkeypatch.setattr(counting, "tensor_overlaps", off_by_one)
    with pytest.raises(SystemExit, match="chunk 2\\^6 counted differently"):
        count_chunk.main(["--elements", "3000", "--repeats", "1", "--chunks", "64"])
