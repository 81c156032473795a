"""Inputs are checked as they stream (shapes, NaN / Inf, buffers) and never
written, by any entry point. Bad inputs are variants of a tiny family's task
model with one tensor edited; "late" means a tensor of the last layer,
merged after many others. (Publishing: test_publish_*.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import reference
import torch
import yaml
from click.testing import CliRunner
from conftest import TaskSpec, merge, read_json, words_for
from faults import tree
from mergekit.scripts.run_yaml import main as stock_mergekit_yaml
from safetensors.torch import load_file, save_file

import mergekit_ram
from mergekit_ram.commands.cli import main
from mergekit_ram.core.errors import RAMInputError

LATE = "model.layers.1.mlp.down_proj.weight"


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


# --- shapes and NaN / Inf ---------------------------------------------------------


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


def poison(state, name=LATE) -> None:
    """Three NaN and one Inf in a late tensor."""
    flat = state[name].view(-1)
    flat[[3, 40, 500]] = float("nan")
    flat[7] = float("inf")


def narrower(state) -> None:
    state[LATE] = state[LATE][:, :60].contiguous()


@pytest.fixture(scope="module")
def variants(family, tmp_path_factory) -> dict[str, str]:
    """beta poisoned, gamma with a narrower late tensor."""
    root = tmp_path_factory.mktemp("variants")
    return {
        "nonfinite": variant(family, "beta", root, poison),
        "shape": variant(family, "gamma", root, narrower),
    }


@pytest.mark.parametrize(
    "method, parameters",
    [("ram", None), ("ramplus", None), ("ramplus", {"statistics": "tensor"})],
)
@pytest.mark.parametrize("bad", ["vocabulary", "shape", "nonfinite"])
def test_refused_while_merging_naming_tensor_model_and_fix(
    bad, method, parameters, family, vocab_family, variants, tmp_path
):
    """Found as the tensors stream (RAM, and RAM+'s statistics pass, global or
    per tensor), before OUT exists."""
    if bad == "vocabulary":
        config = vocab_family.config_dict(method, parameters=parameters)
        paths = vocab_family.paths
        said = [
            paths["wide"],
            paths["base"],
            "(50, 32)",
            "(48, 32)",
            "tokenizer_source",
        ]
    else:
        task = "beta" if bad == "nonfinite" else "gamma"
        config = config_dict(
            family, method, {task: variants[bad]}, parameters=parameters
        )
        said = [LATE, f"model {variants[bad]}"]
        said += ["3 NaN and 1 infinite", "nonfinite: ignore"]
    if bad == "shape":
        said = [LATE, variants[bad], "(32, 64)", "(32, 60)", "architecture"]
    with pytest.raises(RAMInputError) as raised:
        merge(config, tmp_path / "out")
    message = str(raised.value)
    assert [part for part in said if part not in message] == [], message
    if bad == "vocabulary":
        assert "embed_tokens" in message or "lm_head" in message
    assert ("tokenizer_source" in message) == (bad == "vocabulary")
    assert not (tmp_path / "out").exists()


def test_mismatches_in_memory_and_vocabularies_aligned(family, vocab_family, tmp_path):
    """In memory, mergekit checks the shapes (its ValueError) before RAM+
    counts anything; in a config, mergekit's alignment merges vocabularies."""
    states = {name: vocab_family.state(name) for name in ("base", "wide", "same")}
    with pytest.raises(ValueError, match="Tensor size mismatch"):
        mergekit_ram.merge_state_dicts(states, "ramplus", base="base", strict=False)
    name = "model.embed_tokens.weight"
    tensors = [states[m][name] for m in ("base", "wide")]
    with pytest.raises(ValueError, match="Tensor size mismatch"):
        mergekit_ram.merge_tensors(tensors, "ramplus", base_index=0, name=name)
    gamma = family.state("gamma")
    narrower(gamma)
    with pytest.raises(ValueError, match=LATE):
        states = {"base": family.state("base"), "gamma": gamma}
        mergekit_ram.merge_state_dicts(states, "ram", base="base")
    config = vocab_family.config_dict("ram", tokenizer_source="union")
    out = merge(config, tmp_path / "union")
    assert read_json(out / "config.json")["vocab_size"] == 50
    config = vocab_family.config_dict("ramplus")
    out = merge(config, tmp_path / "cut", unsafe_truncate_embeddings=True)
    merged = load_file(str(out / "model.safetensors"))
    assert merged["model.embed_tokens.weight"].shape == (48, 32)


def test_nonfinite_ignore_keeps_the_base_there(family, variants, tmp_path):
    """As the reference with the base's value there; a filter may ignore them
    in one tensor only. The inputs in memory stay as they were, bit for bit,
    whatever merges them."""
    poisoned = variants["nonfinite"]
    settings = dict(r=0.3, alpha=1.0, saturation="clip")
    parameters = {**settings, "nonfinite": "ignore"}
    config = config_dict(family, replace={"beta": poisoned}, parameters=parameters)
    out = merge(config, tmp_path / "out")

    tasks = family.task_states()
    tasks[family.tasks.index("beta")] = load_file(f"{poisoned}/model.safetensors")
    base = family.state("base")
    healed = [
        {k: torch.where(torch.isfinite(v), v, base[k]) for k, v in t.items()}
        for t in tasks
    ]
    expected, lambdas = reference.merge(base, healed, **settings)
    merged = load_file(str(out / "model.safetensors"))
    for name in expected:
        assert torch.equal(merged[name], expected[name]), name
    scales = [row["scale"] for row in read_json(out / "ram_statistics.json")["tasks"]]
    assert scales == pytest.approx(lambdas, rel=1e-12)

    states = {"base": base, **dict(zip(family.tasks, tasks))}
    raw = {
        (m, k): v.clone().view(torch.uint8)
        for m in states
        for k, v in states[m].items()
    }
    in_memory = mergekit_ram.merge_state_dicts(
        states, "ramplus", base="base", parameters=parameters
    )
    for name in expected:
        assert torch.equal(in_memory[name], expected[name]), name
    mergekit_ram.merge_state_dicts(states, "ram", base="base", parameters=parameters)
    for method in ("ram", "ramplus"):
        late = [state[LATE] for state in states.values()]
        mergekit_ram.merge_tensors(
            late, method, base_index=0, name=LATE, parameters=parameters
        )
    for (model, name), was in raw.items():
        assert torch.equal(states[model][name].view(torch.uint8), was), name
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

    with pytest.raises(ValueError, match="'w'"):  # a float base, an integer task
        mergekit_ram.merge_state_dicts(
            {"b": {"w": torch.zeros(4)}, "t": {"w": torch.zeros(4, dtype=torch.int64)}},
            "ram",
            base="b",
        )


# --- inputs are never written ---------------------------------------------------


def never_written(family, config: Path) -> tuple:
    return tree(family.root), config.read_bytes()


THREE = ("alpha", "beta", "gamma")
RUNS = {  # mode: the config's method and options, and a command's args (or run_merge)
    "ram": ("ram", {}),
    "ramplus global": ("ramplus", {}),
    "ramplus tensor-local": ("ramplus", {"parameters": {"statistics": "tensor"}}),
    "explicit unique_scale": (
        "ramplus",
        {"model_parameters": dict.fromkeys(THREE, {"unique_scale": 1.25})},
    ),
    "mergekit-ram merge": ("ramplus", {}, "merge {c} {o}"),
    "mergekit-ram merge --report": ("ramplus", {}, "merge {c} {o} --report {o}-r"),
    "mergekit-ram analyze --out": ("ramplus", {}, "analyze {c} --out {o}"),
    "mergekit-yaml": ("ramplus", {}, "{c} {o}"),
}


@pytest.mark.parametrize("mode", sorted(RUNS))
def test_inputs_never_written(mode, family, tmp_path):
    method, options, *args = RUNS[mode]
    config, out = tmp_path / "merge.yml", tmp_path / "out"
    config.write_text(family.yaml(method, **options), encoding="utf-8")
    before = never_written(family, config)
    if not args:
        merge(yaml.safe_load(config.read_text("utf-8")), out)
    else:
        mergekit_ram.install()
        command = stock_mergekit_yaml if mode == "mergekit-yaml" else main
        args = [arg.format(c=config, o=out) for arg in args[0].split()]
        result = CliRunner().invoke(command, [*args, "--quiet"])
        assert result.exit_code == 0, result.output
    assert never_written(family, config) == before
    assert out.is_dir()


def test_demo_never_writes_its_agents(tmp_path, monkeypatch):
    import mergekit.scripts.run_yaml as run_yaml

    real, seen = run_yaml.main, []

    def agents() -> tuple:
        return tree(tmp_path / "models"), (tmp_path / "ramplus.yml").read_bytes()

    def hashing_main(args, **kwargs):
        seen.append(agents())
        return real(args, **kwargs)

    monkeypatch.setattr(run_yaml, "main", hashing_main)
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert seen[0][0] and agents() == seen[0]
