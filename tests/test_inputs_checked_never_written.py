"""Inputs are checked as they stream (shapes, NaN / Inf, buffers) and never
written, by any entry point. Bad inputs are variants of a tiny family's task
model with one tensor edited; "late" means a tensor of the last layer,
merged after many others. (Publishing: test_publish_*.py.)"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import reference
import torch
import yaml
from click.testing import CliRunner
from conftest import TaskSpec, merge, read_json, words_for
from safetensors.torch import load_file, save_file

import mergekit_ram
from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError

BIN = Path(sys.executable).parent
LATE = "model.layers.1.mlp.down_proj.weight"
TIMEOUT = 300


@pytest.fixture(scope="module")
def family(model_family):
    return model_family("safety", seed=21)


def variant(family, task: str, root: Path, edit) -> str:
    """A copy of `task`'s checkpoint folder with edit(state) applied."""
    path = root / f"{task}-variant"
    shutil.copytree(family.paths[task], path)
    state = family.state(task)
    edit(state)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def config_dict(family, method="ramplus", replace=None, **kwargs) -> dict:
    """family.config_dict with some models' paths replaced ({task: path})."""
    config = family.config_dict(method, **kwargs)
    for task, path in (replace or {}).items():
        for entry in config["models"]:
            if entry["model"] == family.paths[task]:
                entry["model"] = path
    return config


def assert_looks_incomplete(out: Path) -> None:
    """Nothing in `out` (new before the merge) loads as a model."""
    assert not out.exists(), os.listdir(out)


def hashes(*paths: Path | str) -> dict[str, str]:
    """sha256 of every file under the given folders (or of the given files)."""
    found = {}
    for top in map(Path, paths):
        files = [top] if top.is_file() else sorted(top.rglob("*"))
        for path in files:
            if path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


# --- shapes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab_family(model_family):
    return model_family(
        "safety-vocab",
        tasks=(
            TaskSpec("wide", words=words_for(48) + ("x1", "x2")),
            TaskSpec("same"),
        ),
        seed=22,
    )


@pytest.mark.parametrize(
    "method, parameters",
    [("ram", None), ("ramplus", None), ("ramplus", {"statistics": "tensor"})],
)
def test_vocabulary_mismatch_points_to_tokenizer_source(
    method, parameters, vocab_family, tmp_path
):
    config = vocab_family.config_dict(method, parameters=parameters)
    with pytest.raises(RAMInputError) as raised:
        merge(config, tmp_path / "out")
    message = str(raised.value)
    assert vocab_family.paths["wide"] in message
    assert vocab_family.paths["base"] in message
    assert "(50, 32)" in message and "(48, 32)" in message
    assert "tokenizer_source" in message
    assert "embed_tokens" in message or "lm_head" in message
    assert_looks_incomplete(tmp_path / "out")


def test_vocabulary_mismatch_merges_with_mergekit_alignment(vocab_family, tmp_path):
    """In a config, mergekit's alignment merges it; in memory, mergekit checks
    the shapes (its ValueError) before RAM+ counts anything."""
    states = {name: vocab_family.state(name) for name in ("base", "wide", "same")}
    with pytest.raises(ValueError, match="Tensor size mismatch"):
        mergekit_ram.merge_state_dicts(states, "ramplus", base="base", strict=False)
    name = "model.embed_tokens.weight"
    tensors = [states[m][name] for m in ("base", "wide")]
    with pytest.raises(ValueError, match="Tensor size mismatch"):
        mergekit_ram.merge_tensors(tensors, "ramplus", base_index=0, name=name)
    config = vocab_family.config_dict("ram", tokenizer_source="union")
    out = merge(config, tmp_path / "union")
    assert read_json(out / "config.json")["vocab_size"] == 50
    config = vocab_family.config_dict("ramplus")
    out = merge(config, tmp_path / "cut", unsafe_truncate_embeddings=True)
    merged = load_file(str(out / "model.safetensors"))
    assert merged["model.embed_tokens.weight"].shape == (48, 32)


def test_shape_mismatch_is_refused_naming_tensor_and_model(family, tmp_path):
    def narrower(state):
        state[LATE] = state[LATE][:, :60].contiguous()

    path = variant(family, "gamma", tmp_path, narrower)
    with pytest.raises(RAMInputError) as raised:
        merge(config_dict(family, replace={"gamma": path}), tmp_path / "out")
    message = str(raised.value)
    assert LATE in message and path in message
    assert "(32, 64)" in message and "(32, 60)" in message
    assert "tokenizer_source" not in message and "architecture" in message
    assert_looks_incomplete(tmp_path / "out")

    # RAM (no statistics pass) refuses it too.
    with pytest.raises(RAMInputError, match=LATE):
        merge(config_dict(family, "ram", replace={"gamma": path}), tmp_path / "o2")
    assert_looks_incomplete(tmp_path / "o2")
    states = {
        "base": family.state("base"),
        "gamma": load_file(f"{path}/model.safetensors"),
    }
    with pytest.raises(ValueError, match=LATE):  # mergekit's own shape check
        mergekit_ram.merge_state_dicts(states, "ram", base="base")


# --- NaN and Inf ----------------------------------------------------------------


def poison(state, name=LATE) -> None:
    """Three NaN and one Inf in a late tensor."""
    flat = state[name].view(-1)
    flat[[3, 40, 500]] = float("nan")
    flat[7] = float("inf")


@pytest.fixture(scope="module")
def poisoned(family, tmp_path_factory):
    return variant(family, "beta", tmp_path_factory.mktemp("poisoned"), poison)


@pytest.mark.parametrize(
    "method, parameters",
    [("ramplus", None), ("ram", None), ("ramplus", {"statistics": "tensor"})],
)
def test_nonfinite_refused_naming_model_tensor_and_count(
    method, parameters, family, poisoned, tmp_path
):
    config = config_dict(family, method, {"beta": poisoned}, parameters=parameters)
    with pytest.raises(RAMInputError) as raised:
        merge(config, tmp_path / "out")
    message = str(raised.value)
    assert LATE in message and f"model {poisoned}" in message
    assert "3 NaN and 1 infinite" in message
    assert "nonfinite: ignore" in message
    assert_looks_incomplete(tmp_path / "out")


def sanitized(family, tasks: list[dict]) -> list[dict]:
    """Task states with every non-finite element set to the base's value."""
    base = family.state("base")
    out = []
    for state in tasks:
        fixed = dict(state)
        for name, tensor in state.items():
            fixed[name] = torch.where(torch.isfinite(tensor), tensor, base[name])
        out.append(fixed)
    return out


def test_nonfinite_ignore_keeps_the_base_there(family, poisoned, tmp_path):
    settings = dict(r=0.3, alpha=1.0, saturation="clip")
    parameters = {**settings, "nonfinite": "ignore"}
    config = config_dict(family, replace={"beta": poisoned}, parameters=parameters)
    out = merge(config, tmp_path / "out")

    tasks = family.task_states()
    tasks[family.tasks.index("beta")] = load_file(f"{poisoned}/model.safetensors")
    base = family.state("base")
    expected, lambdas = reference.merge(base, sanitized(family, tasks), **settings)
    merged = load_file(str(out / "model.safetensors"))
    for name in expected:
        assert torch.equal(merged[name], expected[name]), name
    scales = [row["scale"] for row in read_json(out / "ram_statistics.json")["tasks"]]
    assert scales == pytest.approx(lambdas, rel=1e-12)

    states = {"base": base, **dict(zip(family.tasks, tasks))}
    in_memory = mergekit_ram.merge_state_dicts(
        states, "ramplus", base="base", parameters=parameters
    )
    for name in expected:
        assert torch.equal(in_memory[name], expected[name]), name
    # ignore for the poisoned tensor only merges; for another one, refused.
    only_late = [{"filter": "down_proj", "value": "ignore"}, {"value": "refuse"}]
    parameters = {"nonfinite": only_late}
    config = config_dict(family, replace={"beta": poisoned}, parameters=parameters)
    assert (merge(config, tmp_path / "late") / "config.json").is_file()
    parameters = {"nonfinite": [{"filter": "up_proj", "value": "ignore"}]}
    config = config_dict(family, replace={"beta": poisoned}, parameters=parameters)
    with pytest.raises(RAMInputError, match=LATE):
        merge(config, tmp_path / "other")


def test_nonfinite_in_memory_refused_and_in_the_base_ignored(family):
    """Refused naming the task or the base model; with ignore, a non-finite
    base element is kept as it is."""
    base, task = family.state("base"), family.state("beta")
    poison(task)
    with pytest.raises(RAMInputError, match="model beta has 3 NaN and 1 inf"):
        mergekit_ram.merge_state_dicts({"base": base, "beta": task}, "ram", base="base")
    poison(base)
    with pytest.raises(RAMInputError, match="base model base has 3 NaN"):
        mergekit_ram.merge_state_dicts(
            {"base": base, "beta": family.state("beta")}, "ramplus", base="base"
        )
    bad = ~torch.isfinite(base[LATE])
    tasks = family.task_states()
    merged = mergekit_ram.merge_state_dicts(
        {"base": base, **dict(zip(family.tasks, tasks))},
        "ramplus",
        base="base",
        parameters={"nonfinite": "ignore"},
    )
    # Elsewhere: the reference with those elements unchanged in every task.
    finite_base = {k: torch.where(torch.isfinite(v), v, 0.0) for k, v in base.items()}
    unchanged = [
        {k: torch.where(torch.isfinite(base[k]), v, 0.0) for k, v in t.items()}
        for t in tasks
    ]
    expected, _ = reference.merge(finite_base, unchanged, r=0.1)
    got = merged[LATE]
    assert torch.equal(got[bad].isnan(), base[LATE][bad].isnan())
    assert torch.equal(got[bad].isinf(), base[LATE][bad].isinf())
    assert torch.equal(got[~bad], expected[LATE][~bad])
    for name in expected:
        if name != LATE:
            assert torch.equal(merged[name], expected[name]), name


# --- integer and bool buffers ---------------------------------------------------


def test_buffers_pass_through_from_the_base(family):
    base, tasks = family.state("base"), family.task_states()
    counter = torch.tensor([2**40 + 1, 7], dtype=torch.int64)
    mask = torch.tensor([True, False, True])

    def with_buffers(state, shift):
        return {**state, "counter": counter + shift, "mask": mask ^ bool(shift)}

    states = {"base": with_buffers(base, 0)}
    states.update(
        {n: with_buffers(t, i + 1) for i, (n, t) in enumerate(zip(family.tasks, tasks))}
    )
    merged = mergekit_ram.merge_state_dicts(states, "ramplus", base="base")
    assert merged["counter"].dtype == torch.int64
    assert torch.equal(merged["counter"], counter)
    assert torch.equal(merged["mask"], mask)
    # Skipped by the statistics: the float tensors merge as without buffers.
    plain = mergekit_ram.merge_state_dicts(
        {"base": base, **dict(zip(family.tasks, tasks))}, "ramplus", base="base"
    )
    for name in plain:
        assert torch.equal(merged[name], plain[name]), name

    out = mergekit_ram.merge_tensors([counter, counter + 5], "ram", base_index=0)
    assert torch.equal(out, counter)
    with pytest.raises(ValueError, match="'w'"):  # a float base, an integer task
        mergekit_ram.merge_state_dicts(
            {"b": {"w": torch.zeros(4)}, "t": {"w": torch.zeros(4, dtype=torch.int64)}},
            "ram",
            base="b",
        )


# --- inputs are never written ---------------------------------------------------


def _cli(*args: str) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output


def _mergekit_yaml(config: Path, out: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("MERGEKIT_RAM_AUTOLOAD", None)
    done = subprocess.run(
        [str(BIN / "mergekit-yaml"), str(config), str(out), "--quiet"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr


RUNNERS = {
    "run_merge": lambda c, o: merge(yaml.safe_load(c.read_text("utf-8")), o),
    "mergekit-ram merge": lambda c, o: _cli("merge", str(c), str(o), "--quiet"),
    "mergekit-ram merge --report": lambda c, o: _cli(
        "merge", str(c), str(o), "--quiet", "--report", f"{o}-report"
    ),
    "mergekit-ram analyze --out": lambda c, o: _cli(
        "analyze", str(c), "--out", str(o), "--quiet"
    ),
    "mergekit-yaml": _mergekit_yaml,
}
EXPLICIT = {"unique_scale": 1.25}
MODES = {
    "ram": ("ram", {}, "run_merge"),
    "ramplus global": ("ramplus", {}, "run_merge"),
    "ramplus tensor-local": (
        "ramplus",
        {"parameters": {"statistics": "tensor"}},
        "run_merge",
    ),
    "explicit unique_scale": (
        "ramplus",
        {"model_parameters": {t: EXPLICIT for t in ("alpha", "beta", "gamma")}},
        "run_merge",
    ),
    **{runner: ("ramplus", {}, runner) for runner in list(RUNNERS)[1:]},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_inputs_never_written(mode, family, tmp_path):
    method, options, runner = MODES[mode]
    config = tmp_path / "merge.yml"
    config.write_text(family.yaml(method, **options), encoding="utf-8")
    before = hashes(family.root, config)
    RUNNERS[runner](config, tmp_path / "out")
    assert hashes(family.root, config) == before
    assert (tmp_path / "out").is_dir()


def test_in_memory_inputs_unchanged_bit_for_bit(family):
    states = {
        "base": family.state("base"),
        **dict(zip(family.tasks, family.task_states())),
    }
    poison(states["beta"])
    raw = {
        model: {name: t.clone().view(torch.uint8) for name, t in state.items()}
        for model, state in states.items()
    }
    parameters = {"nonfinite": "ignore"}
    for method in ("ram", "ramplus"):
        mergekit_ram.merge_state_dicts(
            states, method, base="base", parameters=parameters
        )
        mergekit_ram.merge_tensors(
            [states[m][LATE] for m in states],
            method,
            base_index=0,
            name=LATE,
            parameters=parameters,
        )
    for model, state in states.items():
        for name, tensor in state.items():
            assert torch.equal(tensor.view(torch.uint8), raw[model][name]), name


def test_demo_never_writes_its_agents(tmp_path, monkeypatch):
    import mergekit.scripts.run_yaml as run_yaml

    real = run_yaml.main
    seen = {}

    def hashing_main(args, **kwargs):
        seen["before"] = hashes(tmp_path / "models", tmp_path / "ramplus.yml")
        return real(args, **kwargs)

    monkeypatch.setattr(run_yaml, "main", hashing_main)
    _cli("demo", "--out", str(tmp_path))
    after = hashes(tmp_path / "models", tmp_path / "ramplus.yml")
    assert seen["before"] and after == seen["before"]
