"""Safety: inputs are checked as they stream and never written, and a merge
that fails or is killed leaves the output folder as it was.

Bad inputs are variants of a tiny family's task model with one tensor
edited; "late" means a tensor of the last layer, merged after many others.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import mergekit.merge
import pytest
import reference
import torch
import yaml
from click.testing import CliRunner
from conftest import TaskSpec, read_json, words_for
from faults import EXITS, SIGNALS, STATE, check_exit, ours_left, run_interrupted
from mergekit.architecture import WeightInfo
from mergekit.common import ImmutableMap, ModelReference
from mergekit.config import MergeConfiguration
from mergekit.io.tasks import GatherTensors
from mergekit.options import MergeOptions
from safetensors.torch import load_file, save_file

import mergekit_ram
import mergekit_ram.integration.methods
import mergekit_ram.integration.output_folder
import mergekit_ram.integration.publishing
from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import WRITTEN_WEIGHTS as WEIGHTS
from mergekit_ram.integration.install import patch_run_merge
from mergekit_ram.integration.methods import RAMMergeTask
from mergekit_ram.integration.publishing import guarded_run_merge

BIN = Path(sys.executable).parent
LATE = "model.layers.1.mlp.down_proj.weight"
SHARDS = 16_000  # bytes: the tiny models' merges span several shards
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


def merge(config: dict, out: Path, **options) -> Path:
    mergekit_ram.run_merge(
        MergeConfiguration.model_validate(config),
        str(out),
        MergeOptions(quiet=True, **options),
    )
    return out


def count_kernel_calls(monkeypatch) -> list:
    calls: list = []
    real = mergekit_ram.integration.methods.ram_merge_tensor

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mergekit_ram.integration.methods, "ram_merge_tensor", counted)
    return calls


# What a finished merge of the tiny models has (sharded: with an index).
COMPLETE = {
    "config.json",
    "README.md",
    "mergekit_config.yml",
    "ram_statistics.json",
    "model.safetensors.index.json",
}


def assert_looks_incomplete(out: Path) -> None:
    """Nothing in `out` claims a finished merge: no marker, no weight index."""
    names = set(os.listdir(out)) if out.exists() else set()
    assert not names & COMPLETE, names
    assert not [n for n in names if n.endswith(".index.json")], names


def weight_files(out: Path) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in os.listdir(out) if WEIGHTS.fullmatch(n)}


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
    config = vocab_family.config_dict("ram", tokenizer_source="union")
    out = merge(config, tmp_path / "union")
    assert read_json(out / "config.json")["vocab_size"] == 50
    config = vocab_family.config_dict("ramplus")
    out = merge(config, tmp_path / "cut", unsafe_truncate_embeddings=True)
    merged = load_file(str(out / "model.safetensors"))
    assert merged["model.embed_tokens.weight"].shape == (48, 32)


def test_cli_reports_bad_tensors_without_traceback(vocab_family, tmp_path):
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    config = tmp_path / "ram.yml"
    config.write_text(vocab_family.yaml("ram"), encoding="utf-8")
    for command, args in ((main, ["merge"]), (mergekit_yaml, [])):
        result = CliRunner().invoke(command, [*args, str(config), str(tmp_path / "o")])
        assert result.exit_code == 2, result.output
        assert "Error: Tensor" in result.output and "tokenizer_source" in result.output
        assert "Traceback" not in result.output


def test_vocabulary_mismatch_in_memory_is_mergekits_error(vocab_family):
    """In memory, mergekit checks the shapes (its ValueError) before RAM+
    counts anything."""
    states = {name: vocab_family.state(name) for name in ("base", "wide", "same")}
    with pytest.raises(ValueError, match="Tensor size mismatch"):
        mergekit_ram.merge_state_dicts(states, "ramplus", base="base", strict=False)
    name = "model.embed_tokens.weight"
    tensors = [states[m][name] for m in ("base", "wide")]
    with pytest.raises(ValueError, match="Tensor size mismatch"):
        mergekit_ram.merge_tensors(tensors, "ramplus", base_index=0, name=name)


def test_shape_mismatch_fails_in_statistics_pass_before_merging(
    family, tmp_path, monkeypatch
):
    def narrower(state):
        state[LATE] = state[LATE][:, :60].contiguous()

    path = variant(family, "gamma", tmp_path, narrower)
    calls = count_kernel_calls(monkeypatch)
    with pytest.raises(RAMInputError) as raised:
        merge(config_dict(family, replace={"gamma": path}), tmp_path / "out")
    message = str(raised.value)
    assert LATE in message and path in message
    assert "(32, 64)" in message and "(32, 60)" in message
    assert "tokenizer_source" not in message and "architecture" in message
    assert calls == []  # the global pass caught it: nothing was merged
    assert_looks_incomplete(tmp_path / "out")

    # RAM has no statistics pass: the merge task itself refuses.
    with pytest.raises(RAMInputError, match=LATE):
        merge(config_dict(family, "ram", replace={"gamma": path}), tmp_path / "o2")
    assert_looks_incomplete(tmp_path / "o2")
    states = {
        "base": family.state("base"),
        "gamma": load_file(f"{path}/model.safetensors"),
    }
    with pytest.raises(ValueError, match=LATE):  # mergekit's own shape check
        mergekit_ram.merge_state_dicts(states, "ram", base="base")


def test_float_base_with_integer_task_tensor_is_refused():
    base = torch.zeros(4)
    with pytest.raises(ValueError, match="'w'"):
        mergekit_ram.merge_state_dicts(
            {"b": {"w": base}, "t": {"w": torch.zeros(4, dtype=torch.int64)}},
            "ram",
            base="b",
        )


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
    "method, parameters, merged_first",
    [
        ("ramplus", None, False),  # caught by the statistics pass
        ("ram", None, True),  # caught by the kernel adapter, as it streams
        ("ramplus", {"statistics": "tensor"}, True),
    ],
)
def test_nonfinite_refused_naming_model_tensor_and_count(
    method, parameters, merged_first, family, poisoned, tmp_path, monkeypatch
):
    calls = count_kernel_calls(monkeypatch)
    config = config_dict(family, method, {"beta": poisoned}, parameters=parameters)
    with pytest.raises(RAMInputError) as raised:
        merge(config, tmp_path / "out")
    message = str(raised.value)
    assert LATE in message and f"model {poisoned}" in message
    assert "3 NaN and 1 infinite" in message
    assert "nonfinite: ignore" in message
    assert bool(calls) == merged_first
    assert_looks_incomplete(tmp_path / "out")


def test_nonfinite_refused_in_memory_and_in_the_base(family):
    base = family.state("base")
    task = family.state("beta")
    poison(task)
    with pytest.raises(RAMInputError, match="model beta has 3 NaN and 1 inf"):
        mergekit_ram.merge_state_dicts({"base": base, "beta": task}, "ram", base="base")
    poison(base)
    with pytest.raises(RAMInputError, match="base model base has 3 NaN"):
        mergekit_ram.merge_state_dicts(
            {"base": base, "beta": family.state("beta")}, "ramplus", base="base"
        )


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


def test_nonfinite_can_be_ignored_for_one_tensor(family, poisoned, tmp_path):
    only_late = [{"filter": "down_proj", "value": "ignore"}, {"value": "refuse"}]
    parameters = {"nonfinite": only_late}
    config = config_dict(family, replace={"beta": poisoned}, parameters=parameters)
    assert (merge(config, tmp_path / "late") / "config.json").is_file()
    parameters = {"nonfinite": [{"filter": "up_proj", "value": "ignore"}]}
    config = config_dict(family, replace={"beta": poisoned}, parameters=parameters)
    with pytest.raises(RAMInputError, match=LATE):
        merge(config, tmp_path / "other")


def test_nonfinite_base_with_ignore_keeps_the_base_value(family):
    base = family.state("base")
    poison(base)
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


def test_merge_task_passes_integer_base_through():
    base, task = (ModelReference.parse(p) for p in ("/b", "/t"))
    weight = WeightInfo(name="position_ids")
    merge_task = RAMMergeTask(
        method_name="ram",
        gather_tensors=GatherTensors(
            weight_info=ImmutableMap(data={base: weight, task: weight})
        ),
        model_order=(base, task),
        base_model=base,
        output_weight=weight,
        parameters=ImmutableMap(data={}),
        input_parameters=ImmutableMap(data={}),
    )
    ids = torch.arange(6)
    out = merge_task.execute(tensors={base: ids, task: ids * 2})
    assert out is ids  # mergekit's own task refuses differing buffers


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


def _api(config: Path, out: Path) -> None:
    text = config.read_text(encoding="utf-8")
    merge(yaml.safe_load(text), out)


RUNNERS = {
    "run_merge": _api,
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


def test_output_folder_that_is_an_input_is_refused(family):
    before = hashes(family.root)
    with pytest.raises(RAMInputError, match="would change an input"):
        merge(family.config_dict("ram"), Path(family.paths["gamma"]))
    assert hashes(family.root) == before


# --- a failed or killed merge leaves OUT as it was ------------------------------


@pytest.fixture(scope="module")
def fresh(family, tmp_path_factory):
    """A sharded RAM+ merge into a new folder: what every rerun must equal."""
    out = merge(
        family.config_dict(),
        tmp_path_factory.mktemp("fresh") / "out",
        out_shard_size=SHARDS,
    )
    assert (out / "model.safetensors.index.json").is_file()
    return out


def complete_previous(fresh: Path, out: Path) -> None:
    """A finished merge in `out`, as a previous run left it."""
    shutil.copytree(fresh, out)
    assert COMPLETE <= set(os.listdir(out))


def assert_rerun_equals_fresh(family, fresh: Path, out: Path) -> None:
    merge(family.config_dict(), out, out_shard_size=SHARDS)
    assert weight_files(out) == weight_files(fresh)
    assert COMPLETE <= set(os.listdir(out))
    assert not ours_left(out)


def _raise_on_call(monkeypatch, module, name, error, when) -> None:
    """Make module.name raise `error` on the call for which when(n, *args) holds."""
    real = getattr(module, name)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if when(calls[0], *args):
            raise error
        return real(*args, **kwargs)

    failing.__mergekit_ram__ = real  # our card patch is in place: kept, not redone
    monkeypatch.setattr(module, name, failing)


FAILURES = {
    # mid-merge, after several shards were written
    "kernel error": (
        mergekit_ram.integration.methods,
        "ram_merge_tensor",
        RuntimeError("boom"),
        lambda n, *a: n == 12,
    ),
    "Ctrl-C": (
        mergekit_ram.integration.methods,
        "ram_merge_tensor",
        KeyboardInterrupt(),
        lambda n, *a: n == 12,
    ),
    # after mergekit wrote config.json (into the staging folder)
    "card error": (
        mergekit.merge,
        "generate_card",
        RuntimeError("card failed"),
        lambda *a: True,
    ),
    # publishing: the staged merge is complete, writing its manifest fails
    "publish error": (
        mergekit_ram.integration.output_folder.os,
        "replace",
        OSError(28, "No space left on device"),
        lambda n, src, dst: dst.endswith("manifest.json"),
    ),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_failed_rerun_leaves_the_previous_merge_byte_for_byte(
    failure, family, fresh, tmp_path, monkeypatch
):
    """A rerun that fails while merging, writing the card or writing the
    manifest leaves the previous merge exactly as it was, and says so."""
    out = tmp_path / "out"
    complete_previous(fresh, out)
    (out / "notes.txt").write_text("mine")
    before = hashes(out)
    module, name, error, when = FAILURES[failure]
    _raise_on_call(monkeypatch, module, name, error, when)
    if isinstance(error, OSError):  # the environment: one error, where OUT stands
        said = re.escape(f"{error.strerror}; {out} is as it was")
        with pytest.raises(RAMInputError, match=said):
            merge(family.config_dict(), out, out_shard_size=SHARDS)
    else:  # Ctrl-C or a bug: the exception itself
        with pytest.raises(type(error)):
            merge(family.config_dict(), out, out_shard_size=SHARDS)
    monkeypatch.undo()
    assert hashes(out) == before
    assert not ours_left(out)
    assert_rerun_equals_fresh(family, fresh, out)


@pytest.fixture(scope="module")
def older(family, tmp_path_factory):
    """A previous merge that differs from `fresh` (RAM, not RAM+), with user files."""
    out = merge(
        family.config_dict("ram"),
        tmp_path_factory.mktemp("older") / "out",
        out_shard_size=SHARDS,
    )
    (out / "notes.txt").write_text("mine")
    return out


@pytest.mark.slow
def test_mergekit_yaml_interrupted_at_every_publish_step(
    family, fresh, older, poisoned, tmp_path
):
    """The real mergekit-yaml killed (SIGKILL), terminated (SIGTERM),
    interrupted (SIGINT) or hung up on (SIGHUP) at every file-system step of
    its run, then a next merge that fails (a NaN) and one that succeeds: OUT
    is the old merge, the new one or a folder without config.json, with the
    user's file; the failing run leaves it so; the succeeding one publishes
    exactly its merge, and nothing of ours is left."""
    config = tmp_path / "ramplus.yml"
    config.write_text(family.yaml(), encoding="utf-8")
    notes = {"notes.txt": _relative_hashes(older)["notes.txt"]}

    def run(step: int, how: str, out: Path):
        args = [str(config), str(out), "--out-shard-size", str(SHARDS), "--quiet"]
        return run_interrupted(tmp_path, step, how, "mergekit-yaml", args)

    out = tmp_path / "count" / "out"
    shutil.copytree(older, out)
    code, output, steps = run(0, "SIGKILL", out)
    assert code == 0, output
    states = {"old": _relative_hashes(older), "new": _relative_hashes(out)}
    assert states["new"] == {**_relative_hashes(fresh), **notes} != states["old"]

    def state(out: Path) -> str:
        found = _relative_hashes(out) if out.exists() else None
        name = next((k for k, v in states.items() if v == found), None)
        if name is None and found is not None and "config.json" not in found:
            assert found["notes.txt"] == notes["notes.txt"]
            ours = {k: (states["old"].get(k), states["new"].get(k)) for k in found}
            assert all(v in ours[k] for k, v in found.items()), found
            return "half"
        return name or f"mixed {found}"

    seen = set()
    for step in range(1, steps + 1):
        # Every step once, the signal taking turns (the protocol test in
        # test_integration_output_folder.py sends all four at every step).
        how = SIGNALS[step % len(SIGNALS)]
        out = tmp_path / f"{step}-{how}" / "out"
        shutil.copytree(older, out)
        code, output, _ = run(step, how, out)
        assert code in EXITS[how], (step, how, output[-2000:])
        found = state(out)
        seen.add(found)
        if how != "SIGKILL":
            check_exit(how, code, found, output[-2000:])
        with pytest.raises(RAMInputError, match="NaN"):
            merge(config_dict(family, replace={"beta": poisoned}), out)
        assert state(out) == found, (step, how)
        assert not ours_left(out), (step, how)
        merge(family.config_dict(), out, out_shard_size=SHARDS)
        assert state(out) == "new" and not ours_left(out), (step, how)
        shutil.rmtree(out.parent)
    assert {"old", "new", "half"} <= seen, seen


# Written anew by every run (timings, the run's recipe text): compared by name.
VOLATILE = {"README.md", "ram_statistics.json", "mergekit_config.yml"}


def _relative_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under folder but our own (by presence for
    VOLATILE ones)."""
    return {
        str(p.relative_to(folder)): "present"
        if p.name in VOLATILE
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).parts[0] != STATE
    }


# --- wiring ---------------------------------------------------------------------


def test_mergekit_yaml_and_api_call_the_wrapper(family, tmp_path, monkeypatch):
    import mergekit.scripts.run_yaml as run_yaml

    assert run_yaml.run_merge is mergekit.merge.run_merge
    assert hasattr(mergekit.merge.run_merge, "__mergekit_ram__")
    seen = []
    monkeypatch.setattr(mergekit.merge, "run_merge", lambda *a, **k: seen.append(a))
    config = MergeConfiguration.model_validate(family.config_dict())
    mergekit_ram.run_merge(config, str(tmp_path), MergeOptions())
    assert len(seen) == 1 and seen[0][0] == config and seen[0][0] is not config


def test_scripts_bound_before_the_patch_are_rebound(monkeypatch):
    def original(merge_config, out_path, options, config_source=None):
        return "stock"

    merge_module = types.ModuleType("mergekit.merge")
    merge_module.run_merge = merge_module.generate_card = original
    script = types.ModuleType("mergekit.scripts.early")
    script.run_merge = original
    monkeypatch.setitem(sys.modules, "mergekit.scripts.early", script)
    patch_run_merge(merge_module)
    assert merge_module.run_merge.__mergekit_ram__ is original
    assert script.run_merge is merge_module.run_merge
    patch_run_merge(merge_module)  # idempotent
    assert merge_module.run_merge.__mergekit_ram__ is original


def test_other_methods_are_left_to_mergekit(family, tmp_path):
    calls = []
    wrapped = guarded_run_merge(lambda *a, **k: calls.append((a, k)))
    config = MergeConfiguration.model_validate(family.config_dict("task_arithmetic"))
    (tmp_path / "config.json").write_text("{}")
    wrapped(config, str(tmp_path), MergeOptions())
    assert calls == [
        ((config, str(tmp_path)), {"options": MergeOptions(), "config_source": None})
    ]
    assert (tmp_path / "config.json").exists()  # nothing cleared


def test_configuration_is_validated_before_anything_is_touched(
    family, fresh, tmp_path, monkeypatch
):
    def refuse(config, options, document):
        raise RAMInputError("bad config")

    monkeypatch.setattr(mergekit_ram.integration.publishing, "check_config", refuse)
    out = tmp_path / "out"
    complete_previous(fresh, out)
    before = hashes(out)
    with pytest.raises(RAMInputError, match="bad config"):
        merge(family.config_dict(), out)
    assert hashes(out) == before  # the previous merge is left as it was


def test_rerun_removes_stale_shards_and_keeps_other_files(family, fresh, tmp_path):
    out = tmp_path / "out"
    complete_previous(fresh, out)
    (out / "notes.txt").write_text("mine")
    merge(family.config_dict(), out)
    assert sorted(weight_files(out)) == ["model.safetensors"]
    assert (out / "notes.txt").read_text() == "mine"
