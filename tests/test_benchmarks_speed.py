"""benchmarks/speed.py: its helpers, main with the merges stubbed out, and (slow)
one tiny end-to-end run."""

from __future__ import annotations

import os
import shutil
import subprocess
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
\tFile system inputs: 2000000
\tFile system outputs: 16
\tExit status: 0
"""
GB = 1_000_000_000


def test_parse_time_v_reads_wall_rss_user_system_and_bytes_read():
    run = speed.parse_time_v(TIME_V)
    # File system inputs are 512-byte blocks: 2,000,000 of them are 1.024 GB.
    expected = speed.Run(wall=62.5, rss=2345678, user=12.5, system=1.25, read=1.024e9)
    assert run == expected
    hours = TIME_V.replace("1:02.50", "1:00:01")
    assert speed.parse_time_v(hours).wall == 3601.0


@pytest.mark.parametrize("label", ["Maximum resident", "File system inputs"])
def test_parse_time_v_refuses_output_without_the_fields(label):
    with pytest.raises(ValueError, match=label):
        speed.parse_time_v(TIME_V.replace(label, "Something else"))


@pytest.mark.parametrize("size", list(speed.SIZES))
def test_parameter_count_matches_the_tensors_built(size):
    total = sum(prod(shape) for _, shape in speed.tensor_shapes(size))
    assert speed.parameter_count(size) == total


def test_named_sizes_are_what_they_say():
    assert 130e6 < speed.parameter_count("135m") < 170e6
    assert speed.parameter_count("1b") >= 1e9


def test_3b_is_llama_3_2_3b_with_an_untied_head():
    hidden, vocab, layers = 3072, 128256, 28
    q_o = 2 * hidden * hidden  # 24 heads of 128
    k_v = 2 * hidden * 8 * 128  # 8 key/value heads of 128
    mlp = 3 * hidden * 8192
    norms = 2 * hidden
    per_layer = q_o + k_v + mlp + norms  # 100,669,440
    embed_and_head = 2 * vocab * hidden
    assert speed.parameter_count("3b") == (embed_and_head + layers * per_layer + hidden)
    assert speed.parameter_count("3b") == 3_606_752_256
    # Llama-3.2-3B ties its head: 3.21 B without it.
    assert speed.parameter_count("3b") - vocab * hidden == 3_212_749_824
    # Base + 3 agents in bf16 exceed a 24 GB machine's memory.
    assert 4 * speed.BF16_BYTES * speed.parameter_count("3b") > 24 * GB


def test_disk_needed_counts_models_not_built_yet_one_output_and_margin(tmp_path):
    model = speed.BF16_BYTES * speed.parameter_count("small")
    tiny = speed.BF16_BYTES * speed.parameter_count("tiny")
    needed = speed.disk_needed(["tiny", "small"], [3], str(tmp_path))
    assert needed == 4 * tiny + 4 * model + model + speed.DISK_MARGIN
    (tmp_path / "small-3").mkdir()
    (tmp_path / "small-3" / "complete").touch()
    needed = speed.disk_needed(["tiny", "small"], [3], str(tmp_path))
    assert needed == 4 * tiny + model + speed.DISK_MARGIN


def test_disk_problem_says_folder_need_free_and_the_fix(monkeypatch, tmp_path):
    usage = shutil._ntuple_diskusage(total=100 * GB, used=88 * GB, free=12 * GB)
    monkeypatch.setattr(speed.shutil, "disk_usage", lambda folder: usage)
    message = speed.disk_problem(str(tmp_path), 38_100_000_000)
    assert str(tmp_path) in message
    assert "38.1 GB" in message and "12.0 GB is free" in message
    assert "--workdir" in message
    assert "\n" not in message
    assert speed.disk_problem(str(tmp_path), 12 * GB) is None


def test_agent_densities_start_with_the_papers_and_stay_below_one():
    assert speed.agent_densities(3) == list(speed.DENSITIES)
    six = speed.agent_densities(6)
    assert six[:3] == list(speed.DENSITIES) and len(set(six)) == 6
    assert all(0 < d < 1 for d in speed.agent_densities(30))


def test_table_reports_ratios_to_stock_ram():
    runs = {
        speed.BASELINE: [
            speed.Run(10, 1000, 1, 1, 20 * GB),
            speed.Run(12, 3000, 1, 1, 30 * GB),
        ],
        "our ram": [speed.Run(5.5, 1000, 1, 1, 50 * GB)],
    }
    lines = speed.table(runs)
    assert lines[0].startswith("| method | wall s (median) | ÷ stock ram ")
    assert "| peak RSS GB | ÷ stock ram | read GB | ÷ stock ram |" in lines[0]
    assert lines[1].count("---") == lines[0].count("|") - 1
    assert "| stock ram | 11.0 | 1.00× | 0.00 | 1.00× | 25.00 | 1.00× |" in lines[2]
    assert "| our ram | 5.5 | 0.50× | 0.00 | 0.50× | 50.00 | 2.00× |" in lines[3]


def test_table_ratio_to_nothing_read_is_a_dash():
    runs = {speed.BASELINE: [speed.Run(10, 1000, 1, 1, 0)]}
    runs["our ram"] = [speed.Run(5, 1000, 1, 1, GB)]
    assert "| 1.00 | – |" in speed.table(runs)[3]


def test_drop_caches_refused_before_anything_is_built(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(speed.os, "geteuid", lambda: 1000)
    code = speed.main(["--sizes", "tiny", "--workdir", str(tmp_path), "--drop-caches"])
    assert code == 2
    assert "only root" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_too_little_disk_stops_before_building(monkeypatch, tmp_path, capsys):
    usage = shutil._ntuple_diskusage(total=GB, used=GB, free=0)
    monkeypatch.setattr(speed.shutil, "disk_usage", lambda folder: usage)
    code = speed.main(["--sizes", "tiny", "--workdir", str(tmp_path)])
    assert code == 2
    assert "--workdir" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_caches_dropped_before_every_run(monkeypatch, tmp_path):
    events = []

    def run_once(name, paths, workdir, cuda, tree=None, digest=False):
        events.append(name)
        return speed.Run(1.0, 1000, 1.0, 1.0, 2 * GB if "ramplus" in name else GB)

    monkeypatch.setattr(speed, "drop_caches_problem", lambda: None)
    monkeypatch.setattr(speed, "drop_caches", lambda: events.append("drop"))
    monkeypatch.setattr(speed, "build_models", lambda *a: {"base": "b", "x": "x"})
    monkeypatch.setattr(speed, "run_once", run_once)
    output = tmp_path / "table.md"
    methods = ["our ramplus (global)"]
    code = speed.main(
        ["--sizes", "tiny", "--rounds", "2", "--workdir", str(tmp_path)]
        + ["--drop-caches", "--methods", *methods, "--output", str(output)]
    )
    assert code == 0
    pair = ["drop", speed.BASELINE, "drop", methods[0]]
    assert events == pair + pair
    text = output.read_text()
    assert "page cache dropped before every run" in text
    assert (
        "| our ramplus (global) | 1.0 | 1.00× | 0.00 | 1.00× | 2.00 | 2.00× |" in text
    )


def test_compare_runs_our_methods_again_with_the_other_checkouts_code(
    monkeypatch, tmp_path
):
    old = tmp_path / "old"
    (old / "mergekit_ram").mkdir(parents=True)
    calls = []

    def run_once(name, paths, workdir, cuda, tree=None, digest=False):
        calls.append((name, tree, digest))
        return speed.Run(2.0 if tree else 1.0, 1000, 1.0, 1.0, GB, "ab" * 32)

    monkeypatch.setattr(speed, "build_models", lambda *a: {"base": "b", "x": "x"})
    monkeypatch.setattr(speed, "run_once", run_once)
    output = tmp_path / "table.md"
    code = speed.main(
        ["--sizes", "tiny", "--rounds", "1", "--workdir", str(tmp_path / "w")]
        + ["--methods", "our ram", "--compare", f"before={old}", "--hash"]
        + ["--output", str(output)]
    )
    assert code == 0
    # stock rows are not repeated: the other checkout's code is ours only
    assert calls == [
        (speed.BASELINE, None, True),
        ("our ram", None, True),
        ("our ram", str(old), True),
    ]
    text = output.read_text()
    assert "| our ram [before] | 2.0 | 2.00× |" in text
    assert text.count("`abababababab` |") == 3


def test_compare_methods_limits_the_repeated_rows(tmp_path):
    (tmp_path / "mergekit_ram").mkdir()
    methods = [speed.BASELINE, "our ram", "our ramplus (global)"]
    rows = speed.variants(methods, [f"b={tmp_path}"], ["our ramplus (global)"])
    assert list(rows) == methods + ["our ramplus (global) [b]"]
    assert rows["our ramplus (global) [b]"] == ("our ramplus (global)", str(tmp_path))


@pytest.mark.parametrize("entry", ["nolabel", "=path", "x="])
def test_compare_needs_label_and_a_checkout(tmp_path, entry):
    with pytest.raises(SystemExit, match="LABEL=PATH"):
        speed.variants(["our ram"], [entry])
    with pytest.raises(SystemExit, match="holds no mergekit_ram"):
        speed.variants(["our ram"], [f"x={tmp_path}"])


def test_run_once_puts_the_checkout_first_on_pythonpath_and_hashes(
    monkeypatch, tmp_path
):
    seen = {}

    def fake_run(command, env, **kwargs):
        seen["env"] = env
        out = tmp_path / "out"
        out.mkdir()
        (out / "model-00001.safetensors").write_bytes(b"weights")
        (out / "ram_statistics.json").write_text('{"seconds": 1}')
        return subprocess.CompletedProcess(command, 0, "", TIME_V)

    monkeypatch.setattr(speed.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    run = speed.run_once(
        "our ram", {"base": "b", "a": "a"}, str(tmp_path), False, "/old/tree", True
    )
    assert seen["env"]["PYTHONPATH"] == os.pathsep.join(["/old/tree", "/elsewhere"])
    assert seen["env"]["MERGEKIT_RAM_AUTOLOAD"] == "1"
    again = tmp_path / "again"
    again.mkdir()
    (again / "model-00001.safetensors").write_bytes(b"weights")
    assert run.digest == speed.output_digest(str(again))
    (again / "model-00001.safetensors").write_bytes(b"weightz")
    assert run.digest != speed.output_digest(str(again))
    assert not (tmp_path / "out").exists()


def test_digest_cell_says_when_rounds_wrote_different_bytes():
    same = [speed.Run(1, 1, 1, 1, 1, "c" * 64)] * 2
    assert speed.digest_cell(same) == "`cccccccccccc`"
    mixed = same + [speed.Run(1, 1, 1, 1, 1, "d" * 64)]
    assert speed.digest_cell(mixed) == "differs between rounds"


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
