"""Global RAM+ end to end through mergekit's planner (mergekit_ram.run_merge).

Every merge here is compared with tests/reference.py, the dense reference of
docs/spec.md, applied to the whole model: float32 checkpoints must match it
bit for bit, bf16 checkpoints must match the float32 reference of the bf16
inputs rounded once to bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import reference
import torch
import yaml
from conftest import TaskSpec, read_json, words_for
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from safetensors.torch import load_file

import mergekit_ram
from mergekit_ram.integration.methods import ramplus

STATISTICS_FILE = "ram_statistics.json"


def spec_default(name: str):
    return next(p.default for p in ramplus.spec.parameters if p.name == name)


EPSILON = spec_default("epsilon")


def run(text: str, out: Path, **options) -> Path:
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True, **options))
    return out


def merged_state(out: Path) -> dict[str, torch.Tensor]:
    assert not (out / "model.safetensors.index.json").exists()
    return load_file(str(out / "model.safetensors"))


def assert_same_state(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert actual[name].shape == expected[name].shape, name
        assert torch.equal(actual[name], expected[name]), name


def assert_statistics(doc, paths, base, tasks, *, r, alpha, saturation, lambdas):
    """ram_statistics.json against the reference's whole-model counts."""
    n = len(tasks)
    C, S, U, hist = reference.csu(reference.counts(base, tasks, EPSILON), n)
    assert doc["epsilon"] == EPSILON
    assert doc["r"] == r
    assert doc["alpha"] == alpha
    assert doc["saturation"] == saturation
    assert doc["statistics"] == "global"
    assert doc["num_tensors"] == len(base)
    assert doc["num_elements"] == sum(t.numel() for t in base.values())
    assert isinstance(doc["seconds"], (int, float)) and doc["seconds"] >= 0
    rows = {row["model"]: row for row in doc["tasks"]}
    assert sorted(rows) == sorted(paths)
    for t, path in enumerate(paths):
        row = rows[path]
        assert row["changed"] == C[t], path
        assert row["shared"] == S[t], path
        assert row["unique"] == U[t], path
        assert row["overlap_histogram"] == hist[t], path
        assert row["elements"] == doc["num_elements"]
        if U[t]:
            assert row["rho"] == pytest.approx(S[t] / U[t], rel=1e-12)
        elif S[t]:
            assert row["rho"] is None
        else:
            assert row["rho"] == 0
        assert row["scale"] == pytest.approx(lambdas[t], rel=1e-12), path


def assert_reference(family, out, settings, base, tasks):
    """The merge in `out` equals the reference's global RAM+ of `base` and
    `tasks`, and its ram_statistics.json the reference's whole-model counts;
    returns the merged state, that document and the reference's λ."""
    expected, lambdas = reference.merge(base, tasks, **settings)
    merged = merged_state(out)
    assert_same_state(merged, expected)
    doc = read_json(out / STATISTICS_FILE)
    paths = [family.paths[n] for n in family.tasks]
    assert_statistics(doc, paths, base, tasks, lambdas=lambdas, **settings)
    return merged, doc, lambdas


CASES = {
    "clip": dict(r=0.3, alpha=1.0, saturation="clip"),
    "soft": dict(r=0.25, alpha=spec_default("alpha"), saturation="soft"),
}


def written(settings: dict) -> dict:
    """The YAML parameters for a case: the soft rule has no alpha to write
    (it is refused there); the reference still takes the default."""
    soft = settings.get("saturation") == "soft"
    return {k: v for k, v in settings.items() if not (soft and k == "alpha")}


@pytest.mark.parametrize("rule", sorted(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_global_ramplus_equals_reference(
    rule, dtype, family_f32, family_bf16, tmp_path
):
    family = family_f32 if dtype == "float32" else family_bf16
    settings = CASES[rule]
    out = run(family.yaml("ramplus", parameters=written(settings)), tmp_path / "out")

    base = family.state("base")
    tasks = family.task_states()
    assert all(t.dtype == getattr(torch, dtype) for t in base.values())
    merged, _, lambdas = assert_reference(family, out, settings, base, tasks)
    assert all(lam > 1 for lam in lambdas)

    # The family is built so that tensor-local statistics would give another
    # model: the global scope is what was computed.
    tensor_scope, _ = reference.merge(base, tasks, statistics="tensor", **settings)
    assert any(not torch.equal(tensor_scope[k], merged[k]) for k in merged)


def test_tied_embeddings_counted_once(model_family, tmp_path):
    family = model_family("tied", tie=True, seed=2)
    base = family.state("base")
    assert "lm_head.weight" not in base
    assert "model.embed_tokens.weight" in base
    settings = CASES["clip"]
    out = run(family.yaml("ramplus", parameters=written(settings)), tmp_path / "out")

    tasks = family.task_states()
    merged, _, lambdas = assert_reference(family, out, settings, base, tasks)
    assert "lm_head.weight" not in merged

    # Counting the shared matrix a second time (as lm_head) changes λ here,
    # so the test would notice a double count.
    doubled = {**base, "lm_head.weight": base["model.embed_tokens.weight"]}
    doubled_tasks = [
        {**t, "lm_head.weight": t["model.embed_tokens.weight"]} for t in tasks
    ]
    _, doubled_lambdas = reference.merge(doubled, doubled_tasks, **settings)
    assert doubled_lambdas != lambdas


def test_union_tokenizer_counts_permuted_tensors(model_family, tmp_path):
    """Different vocabularies: the statistics see mergekit's union layout.

    'wide' has the base's words plus four of its own; 'shuffled' has the
    base's words in another order. The union vocabulary is read from the
    output tokenizer and each model's tensors are permuted into it here,
    independently of mergekit: a row a model has is its own, a token only
    one model has is copied from that model (mergekit's rule), so such a row
    is unchanged in every task.
    """
    from transformers import AutoTokenizer

    base_words = words_for(40)
    extra = tuple(f"x{i}" for i in range(4))
    shuffled = base_words[:3] + tuple(reversed(base_words[3:]))
    family = model_family(
        "union",
        tasks=(
            TaskSpec("wide", density=0.1, words=base_words + extra),
            TaskSpec("shuffled", density=0.2, words=shuffled),
            TaskSpec("same", density=0.3),
        ),
        vocab=40,
        seed=3,
    )
    settings = CASES["clip"]
    text = family.yaml(
        "ramplus", parameters=written(settings), tokenizer_source="union"
    )
    out = run(text, tmp_path / "out")

    vocab = AutoTokenizer.from_pretrained(str(out)).get_vocab()
    assert sorted(vocab) == sorted(base_words + extra)
    assert read_json(out / "config.json")["vocab_size"] == len(vocab)
    order = sorted(vocab, key=vocab.get)
    assert order[: len(base_words)] == list(base_words)

    def permuted(name):
        state = family.state(name)
        own = {w: i for i, w in enumerate(family.words[name])}
        donor = family.state("wide")
        donor_rows = {w: i for i, w in enumerate(family.words["wide"])}
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = []
            for word in order:
                if word in own:
                    rows.append(state[key][own[word]])
                else:
                    rows.append(donor[key][donor_rows[word]])
            state[key] = torch.stack(rows)
        return state

    base = permuted("base")
    tasks = [permuted(n) for n in family.tasks]
    assert base["model.embed_tokens.weight"].shape[0] == len(order)
    _, doc, _ = assert_reference(family, out, settings, base, tasks)

    # Without the permutation the shuffled model would look changed almost
    # everywhere in its vocabulary rows.
    raw_base, raw_shuffled = family.state("base"), family.state("shuffled")
    raw_changed = sum(
        int(((raw_shuffled[k].float() - raw_base[k].float()).abs() > EPSILON).sum())
        for k in raw_base
    )
    rows = {row["model"]: row for row in doc["tasks"]}
    assert rows[family.paths["shuffled"]]["changed"] < raw_changed


@pytest.fixture(scope="module")
def edge_family(model_family):
    return model_family(
        "edge",
        tasks=(
            TaskSpec("wide", density=0.2),
            TaskSpec("narrow", density=0.1),
            TaskSpec("inside", subset_of="wide"),
            TaskSpec("copy", identical=True),
        ),
        seed=4,
    )


@pytest.mark.parametrize("rule", sorted(CASES))
def test_no_unique_and_identical_task(rule, edge_family, tmp_path):
    family = edge_family
    settings = CASES[rule]
    out = run(family.yaml("ramplus", parameters=written(settings)), tmp_path / "out")

    base = family.state("base")
    tasks = family.task_states()
    merged, doc, _ = assert_reference(family, out, settings, base, tasks)
    rows = {row["model"]: row for row in doc["tasks"]}

    inside = rows[family.paths["inside"]]
    assert inside["changed"] > 0 and inside["unique"] == 0
    assert inside["shared"] == inside["changed"]
    assert inside["rho"] is None
    limit = 1 + settings["r"] * (
        settings["alpha"] if settings["saturation"] == "clip" else 1.0
    )
    assert inside["scale"] == pytest.approx(limit, rel=1e-12)

    copy = rows[family.paths["copy"]]
    assert copy["changed"] == copy["shared"] == copy["unique"] == 0
    assert copy["overlap_histogram"] == [0] * len(tasks)
    assert copy["rho"] == 0
    assert copy["scale"] == 1.0

    # λ of the task with no unique element is never applied: any value of it
    # gives the same model.
    changed_scale, _ = reference.merge(
        base, tasks, unique_scale=[None, None, 5.0, None], **settings
    )
    assert_same_state(changed_scale, merged)


def test_single_task_model(family_f32, tmp_path):
    family = family_f32
    settings = CASES["clip"]
    name = family.tasks[1]
    out = run(
        family.yaml("ramplus", parameters=written(settings), tasks=[name]),
        tmp_path / "out",
    )
    base = family.state("base")
    task = family.state(name)
    expected, lambdas = reference.merge(base, [task], **settings)
    assert lambdas == [1.0]
    assert_same_state(merged_state(out), expected)
    # Unique elements are kept as they are: the task model minus its
    # sub-threshold changes, i.e. the task model itself here.
    for key in base:
        assert torch.equal(merged_state(out)[key], task[key]), key
    (row,) = read_json(out / STATISTICS_FILE)["tasks"]
    assert row["changed"] == row["unique"] > 0
    assert row["shared"] == 0 and row["rho"] == 0 and row["scale"] == 1.0


def assert_local_section(card, family, base, tasks, settings) -> None:
    """Issue 30 item 6: the card of a tensor-local merge has its statistics
    section: each agent's counts over the whole model, and the smallest and
    largest λ a tensor gave it, as the dense reference computes them."""
    section = card.split("### RAM+ statistics (tensor-local)")[1]
    rows = {
        cells[0]: cells[1:]
        for line in section.splitlines()
        if line.startswith("| /")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    per_tensor = reference.counts(base, tasks, 1e-5)
    C, S, U, _ = reference.csu(per_tensor, len(tasks))
    elements = sum(t.numel() for t in base.values())
    lams = [
        [
            reference.lam(c[t], s[t], u[t], settings["r"], settings["alpha"], "clip")
            for t in range(len(tasks))
        ]
        for c, s, u, _ in (
            reference.csu({name: counted}, len(tasks))
            for name, counted in per_tensor.items()
        )
    ]
    for t, name in enumerate(family.tasks):
        changed, unique, shared, _rho, lam, _survives = rows[family.paths[name]]
        assert changed == f"{100 * C[t] / elements:.2f} %"
        assert unique == f"{100 * U[t] / C[t]:.2f} %"
        assert shared == f"{100 * S[t] / C[t]:.2f} %"
        low, high = (f(lam_t[t] for lam_t in lams) for f in (min, max))
        assert lam == f"{low:.4f}–{high:.4f}"


def test_tensor_scope_writes_no_statistics_file(family_f32, tmp_path):
    family = family_f32
    settings = CASES["clip"]
    text = family.yaml("ramplus", parameters={**settings, "statistics": "tensor"})
    out = run(text, tmp_path / "out")
    assert not (out / STATISTICS_FILE).exists()
    base = family.state("base")
    tasks = family.task_states()
    card = (out / "README.md").read_text(encoding="utf-8")
    assert_local_section(card, family, base, tasks, settings)
    expected, _ = reference.merge(base, tasks, statistics="tensor", **settings)
    merged = merged_state(out)
    assert_same_state(merged, expected)
    global_scope, _ = reference.merge(base, tasks, **settings)
    assert any(not torch.equal(global_scope[k], merged[k]) for k in merged)
    # A per-tensor filter on r is allowed with tensor-local statistics.
    value = [{"filter": "mlp", "value": 0.4}, {"value": 0.1}]
    text = family.yaml("ramplus", parameters={"r": value, "statistics": "tensor"})
    out = run(text, tmp_path / "filtered")
    mlp, _ = reference.merge(base, tasks, r=0.4, statistics="tensor")
    rest, _ = reference.merge(base, tasks, r=0.1, statistics="tensor")
    expected = {k: (mlp[k] if "mlp" in k else rest[k]) for k in base}
    assert_same_state(merged_state(out), expected)


def test_ram_writes_no_statistics_and_matches_stock(family_f32, tmp_path):
    from mergekit.merge_methods import merge_state_dicts
    from mergekit.merge_methods.ram import ram_merge as stock_ram

    family = family_f32
    out = run(family.yaml("ram"), tmp_path / "out")
    assert not (out / STATISTICS_FILE).exists()
    base = family.state("base")
    tasks = family.task_states()
    merged = merged_state(out)
    expected, _ = reference.merge(base, tasks, r=0.0)
    assert_same_state(merged, expected)

    # Stock mergekit's RAM on the same float32 inputs.
    models = {"base": base, **{f"t{i}": t for i, t in enumerate(tasks)}}
    stock = merge_state_dicts(models, stock_ram, base="base")
    assert sorted(stock) == sorted(merged)
    for key in merged:
        assert torch.equal(merged[key], stock[key]), key
    # ... which ramplus (r > 0) is not.
    plus, _ = reference.merge(base, tasks, r=0.1)
    assert any(not torch.equal(plus[k], merged[k]) for k in merged)


@pytest.mark.parametrize("given", [[1.5, 1.25, 2.0], [1.75, None, None]])
def test_explicit_unique_scale_writes_no_statistics_or_counts_the_rest(
    given, family_f32, tmp_path
):
    family = family_f32
    settings = CASES["soft"]
    text = family.yaml(
        "ramplus",
        parameters=written(settings),
        model_parameters={
            name: {"unique_scale": s}
            for name, s in zip(family.tasks, given)
            if s is not None
        },
    )
    out = run(text, tmp_path / "out")
    base = family.state("base")
    tasks = family.task_states()
    expected, lambdas = reference.merge(base, tasks, unique_scale=given, **settings)
    assert_same_state(merged_state(out), expected)
    if None not in given:
        assert not (out / STATISTICS_FILE).exists()
        return
    rows = {row["model"]: row for row in read_json(out / STATISTICS_FILE)["tasks"]}
    assert rows[family.paths[family.tasks[0]]]["scale"] == given[0]
    for t, name in enumerate(family.tasks[1:], start=1):
        assert rows[family.paths[name]]["scale"] == pytest.approx(lambdas[t], rel=1e-12)


def test_outputs_card_recipe_and_config_untouched(family_f32, tmp_path):
    family = family_f32
    text = family.yaml("ramplus")
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    before = config.model_dump()
    models_before = list(config.models)
    recipe = config.to_yaml()

    out = tmp_path / "out"
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True))

    # The caller's configuration is not rewritten (models -> modules/slices).
    assert config.model_dump() == before
    assert config.models == models_before and config.modules is None
    # The recipe is the user's, without the injected λ.
    written = (out / "mergekit_config.yml").read_text(encoding="utf-8")
    assert written == recipe
    assert "unique_scale" not in written

    doc = read_json(out / STATISTICS_FILE)
    assert doc["r"] == spec_default("r") and doc["alpha"] == spec_default("alpha")
    assert doc["saturation"] == spec_default("saturation")
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "### RAM+ statistics" in card
    assert STATISTICS_FILE in card
    section = card.split("### RAM+ statistics", 1)[1]
    for row in doc["tasks"]:
        line = next(
            x for x in section.splitlines() if x.startswith(f"| {row['model']} |")
        )
        assert f"{row['scale']:.4f}" in line
        if row["rho"] is not None:
            assert f"{row['rho']:.4f}" in line

    # With config_source, mergekit_config.yml is that text verbatim.
    out2 = tmp_path / "out2"
    source = "# my recipe\n" + text
    mergekit_ram.run_merge(
        MergeConfiguration.model_validate(yaml.safe_load(text)),
        str(out2),
        MergeOptions(quiet=True),
        config_source=source,
    )
    assert (out2 / "mergekit_config.yml").read_text(encoding="utf-8") == source
    assert (out2 / "model.safetensors").read_bytes() == (
        out / "model.safetensors"
    ).read_bytes()
