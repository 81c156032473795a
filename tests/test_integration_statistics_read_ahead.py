"""Read-ahead hints: where they point, when they are given, and that they
change nothing the pass or the merge computes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import merge_yaml, read_json
from faults import ours_left
from safetensors.torch import save_file

import mergekit_ram.integration.statistics as prefetch
import mergekit_ram.integration.statistics as statistics_pass


def test_safetensors_spans_point_at_each_tensors_bytes(tmp_path):
    tensors = {
        "a": torch.arange(7, dtype=torch.float32),
        "b.weight": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.tensor([1, 2, 3], dtype=torch.int64),
        "empty": torch.zeros(0),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), {"format": "pt"})
    spans = prefetch.safetensors_spans(str(path))
    data = path.read_bytes()
    assert set(spans) == set(tensors)
    for name, tensor in tensors.items():
        start, length = spans[name]
        raw = tensor.view(torch.uint8) if tensor.numel() else tensor.to(torch.uint8)
        assert data[start : start + length] == bytes(raw.reshape(-1).tolist())


def _header(payload: bytes, declared: int | None = None) -> bytes:
    size = len(payload) if declared is None else declared
    return size.to_bytes(8, "little") + payload


@pytest.mark.parametrize(
    "content",
    [
        b"",  # empty
        b"\x05\x00\x00",  # shorter than the length prefix
        _header(b"{}", declared=0),  # an empty header
        _header(b'{"a": {}}', declared=1 << 40),  # claims more than the file holds
        _header(b"{not json"),
        _header(b"[1, 2]"),  # JSON, not an object
        _header(b'{"a": {"dtype": "F32"}}'),  # no data_offsets
        _header(b'{"a": {"data_offsets": 3}}'),
    ],
    ids=[
        "empty", "short", "zero-header", "oversized-header", "not-json",
        "not-an-object", "no-offsets", "bad-offsets",
    ],
)  # fmt: skip
def test_a_file_that_is_not_safetensors_raises_what_hints_skip(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(prefetch.UNREADABLE):
        prefetch.safetensors_spans(str(path))


class Recorder:
    def __init__(self):
        self.events: list[str] = []

    def hint(self, loads):
        self.events.append(f"hint {loads}")


def test_hinted_asks_for_the_next_group_before_handing_out_this_one():
    recorder = Recorder()
    pairs = iter([("g0", 0), ("g1", 1), ("g2", 2)])
    out = []
    for pair in prefetch.hinted(pairs, ["L0", "L1", "L2"], recorder):
        recorder.events.append(f"count {pair[0]}")
        out.append(pair)
    assert out == [("g0", 0), ("g1", 1), ("g2", 2)]
    assert recorder.events == [
        "hint L0", "hint L1", "count g0", "hint L2", "count g1", "count g2"
    ]  # fmt: skip


OPEN: dict[int, str] = {}  # checkpoint files opened through os.open, not closed


@pytest.fixture
def advised(monkeypatch):
    """Every posix_fadvise call of the pass, as (file, first byte, length);
    checkpoint files opened with os.open are tracked in OPEN until closed."""
    calls: list[tuple[str, int, int]] = []
    real_open, real_close = os.open, os.close

    def record(descriptor, start, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        calls.append((os.readlink(f"/proc/self/fd/{descriptor}"), start, length))

    def opening(path, flags, *args, **kwargs):
        descriptor = real_open(path, flags, *args, **kwargs)
        if str(path).endswith(".safetensors"):
            OPEN[descriptor] = str(path)
        return descriptor

    def closing(descriptor):
        OPEN.pop(descriptor, None)
        real_close(descriptor)

    OPEN.clear()
    monkeypatch.setattr(prefetch.os, "posix_fadvise", record, raising=False)
    monkeypatch.setattr(prefetch.os, "open", opening)
    monkeypatch.setattr(prefetch.os, "close", closing)
    return calls


def test_the_pass_hints_every_input_tensor_once(model_family, tmp_path, advised):
    family = model_family("prefetch", tokenizer=False)
    merge_yaml(family.yaml("ramplus"), tmp_path / "out")
    expected = set()
    for folder in family.paths.values():
        file = os.path.realpath(Path(folder) / "model.safetensors")
        spans = prefetch.safetensors_spans(file)
        expected |= {(file, start, length) for start, length in spans.values()}
    assert len(advised) == len(set(advised))  # no tensor hinted twice
    assert set(advised) == expected
    assert OPEN == {}  # the files the hints opened are closed


ODD = "ünï cödé 'q' \"x\" $HOME ;" + "n" * 200  # spaces, quotes, unicode, long


def test_hints_follow_symlinks_and_odd_long_names(model_family, tmp_path, advised):
    """Inputs under a 230-character name with quotes, spaces and unicode, one
    reached through a symlink: every tensor is hinted in the real file."""
    family = model_family("prefetch-odd", tokenizer=False)
    paths = {}
    for name, folder in family.paths.items():
        copy = tmp_path / f"{name} {ODD}"
        shutil.copytree(folder, copy)
        paths[name] = str(copy)
    link = tmp_path / "linked beta"
    link.symlink_to(paths["beta"], target_is_directory=True)
    paths["beta"] = str(link)
    plain = merge_yaml(family.yaml("ramplus"), tmp_path / "plain")
    advised.clear()
    odd = dataclasses.replace(family, paths=paths)
    weights = merge_yaml(odd.yaml("ramplus"), tmp_path / f"out {ODD}")
    assert weights.keys() == plain.keys()
    assert all(torch.equal(weights[name], plain[name]) for name in plain)
    expected = set()
    for folder in paths.values():
        file = os.path.realpath(Path(folder) / "model.safetensors")
        spans = prefetch.safetensors_spans(file)
        expected |= {(file, start, length) for start, length in spans.values()}
    assert set(advised) == expected and len(advised) == len(expected)
    assert OPEN == {}


# The real mergekit-yaml, terminated while the read-ahead thread is in its
# first hint (sleeping there, so the main thread handles SIGTERM meanwhile;
# 5 s, not less: on a loaded machine the main thread may take a while).
TERMINATED_IN_A_HINT = """
import os, signal, sys, time
from mergekit.scripts.run_yaml import main

real, sent = os.posix_fadvise, []


def advise(*args):
    if not sent:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    real(*args)


os.posix_fadvise = advise
main(sys.argv[1:])
"""


def _hashes(*folders: Path | str) -> dict[str, str]:
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in folders
        for path in sorted(Path(folder).rglob("*"))
        if path.is_file()
    }


def test_sigterm_during_a_hint_leaves_the_previous_merge_as_it_was(
    model_family, tmp_path
):
    family = model_family("prefetch-term", tokenizer=False)
    config = tmp_path / "ramplus.yml"
    config.write_text(family.yaml("ramplus"), encoding="utf-8")
    out = tmp_path / "out"
    merge_yaml(family.yaml("ramplus"), out)  # a previous merge, and a user file
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    before = _hashes(out, *family.paths.values())
    child = subprocess.run(
        [sys.executable, "-c", TERMINATED_IN_A_HINT, str(config), str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert child.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), child.stderr
    assert "Traceback" not in child.stderr
    assert _hashes(out, *family.paths.values()) == before
    assert ours_left(out) == []


@pytest.mark.parametrize("failure", ["missing", "raises"])
def test_merge_is_the_same_without_hints_or_when_they_fail(
    model_family, tmp_path, monkeypatch, failure
):
    family = model_family("prefetch-same", tokenizer=False)
    hinted_weights = merge_yaml(family.yaml("ramplus"), tmp_path / "hinted")
    if failure == "missing":  # Windows: no posix_fadvise
        monkeypatch.delattr(prefetch.os, "posix_fadvise", raising=False)
    else:

        def refuse(*args):
            raise OSError(22, "Invalid argument")

        monkeypatch.setattr(prefetch.os, "posix_fadvise", refuse, raising=False)
    plain_weights = merge_yaml(family.yaml("ramplus"), tmp_path / "plain")
    assert hinted_weights.keys() == plain_weights.keys()
    for name in hinted_weights:
        assert torch.equal(hinted_weights[name], plain_weights[name])

    def statistics(folder):
        data = read_json(tmp_path / folder / "ram_statistics.json")
        data.pop("seconds")
        return json.dumps(data, sort_keys=True)

    assert statistics("hinted") == statistics("plain")


def test_a_pass_that_fails_still_closes_what_it_opened(
    model_family, tmp_path, monkeypatch, advised
):
    family = model_family("prefetch-fail", tokenizer=False)
    calls = {"n": 0}
    count_task = statistics_pass._count_task

    def fail_on_second(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("interrupted")
        count_task(*args)

    monkeypatch.setattr(statistics_pass, "_count_task", fail_on_second)
    with pytest.raises(RuntimeError, match="interrupted"):
        merge_yaml(family.yaml("ramplus"), tmp_path / "out")
    assert advised  # hints were given before the failure
    assert OPEN == {}
