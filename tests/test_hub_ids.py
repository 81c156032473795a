"""Models named by hub id, served by a local stand-in for the hub (tests/hub.py):
revisions of one repo merge as stock merges them, and a hub error stops the
merge with the hub's reason and the host's OSError type, OUT as it was.

huggingface_hub reads HF_ENDPOINT when imported, so the merges run in one
child process (`DRIVER`), through mergekit's own `run_merge`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import merge
from hub import Hub, hub_environ

# Each case: mergekit.merge.run_merge (our wrapper) on a configuration; prints
# whether what it raised is an OSError, and its message ("": it merged).
DRIVER = """
import json, sys
import mergekit.merge
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
for name, document, out in json.loads(sys.argv[1]):
    config, error = MergeConfiguration.model_validate(document), None
    try:
        mergekit.merge.run_merge(config, out, MergeOptions(quiet=True))
    except Exception as raised:
        error = raised
    print(json.dumps([name, isinstance(error, OSError), str(error or "")]))
"""


def run_driver(cases: list, environ: dict[str, str]) -> dict[str, list]:
    env = {**os.environ, **environ, "MERGEKIT_RAM_AUTOLOAD": "1"}
    command = [sys.executable, "-c", DRIVER, json.dumps(cases)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: rest for name, *rest in map(json.loads, done.stdout.splitlines())}


def test_revisions_merge_and_hub_errors_keep_their_type(family_f32, tmp_path):
    paths = family_f32.paths
    repos = {
        "org/base": {"main": paths["base"]},
        "org/agents": {"coder": paths["alpha"], "tool": paths["beta"]},
        "org/secret": {"main": paths["gamma"]},
    }

    def config(*models: str, base: str = "org/base") -> dict:
        document = family_f32.config_dict("ramplus", base_model=base)
        document["models"] = [{"model": name} for name in models]
        return document

    revisions = config("org/agents@coder", "org/agents@tool")
    local = family_f32.config_dict("ramplus", tasks=["alpha", "beta"])
    expected = (merge(local, tmp_path / "local") / "model.safetensors").read_bytes()
    (kept := tmp_path / "kept").mkdir()
    (kept / "notes.txt").write_text("mine")
    cases = [
        ("revisions", revisions, str(tmp_path / "hub")),
        ("no repo", config("org/agents@coder", "org/nope"), str(kept)),
        ("no revision", config("org/agents@coder", "org/agents@nope"), str(kept)),
        ("gated", config("org/agents@coder", "org/secret"), str(kept)),
    ]
    with Hub(repos, gated={"org/secret"}) as hub:
        found = run_driver(cases, hub.environ(tmp_path / "cache"))
    assert found["revisions"] == [False, ""]
    assert (tmp_path / "hub" / "model.safetensors").read_bytes() == expected
    for name, said in (
        ("no repo", "org/nope is not a local folder"),
        ("no revision", "nope is not a valid git identifier"),
        ("gated", "gated repo"),
    ):
        is_os_error, message = found[name]
        assert is_os_error, (name, message)
        assert said in message and f"{kept} is as it was" in message
        assert "Fix what it says" in message and "free space" not in message
    assert sorted(os.listdir(kept)) == ["notes.txt"]


@pytest.mark.slow
def test_offline_with_nothing_cached_is_one_error_naming_it(family_f32, tmp_path):
    """`mergekit-ram merge` in offline mode with a hub id not in the cache:
    one Error paragraph (exit 2) with transformers' reason, OUT as it was."""
    document = family_f32.config_dict("ramplus", base_model="org/base")
    config = tmp_path / "config.yml"
    config.write_text(json.dumps(document))
    env = {**os.environ, **hub_environ("http://127.0.0.1:9", tmp_path / "cache")}
    env["HF_HUB_OFFLINE"] = "1"
    command = [sys.executable, "-m", "mergekit_ram", "merge", str(config), "out"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "Error: The merge into out stopped:" in done.stderr
    assert "out is as it was" in done.stderr
    assert not (tmp_path / "out").exists()
