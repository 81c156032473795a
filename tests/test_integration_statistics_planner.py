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


def run(text: str, out: Path) -> Path:
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True))
    return out


def run_case(family, out: Path, rule: str = "clip", **options) -> Path:
    """Global RAM+ of `family` with CASES[rule]."""
    return run(family.yaml("ramplus", parameters=written(CASES[rule]), **options), out)


def merged_state(out: Path) -> dict[str, torch.Tensor]:
    assert not (out / "model.safetensors.index.json").exists()
    return load_file(str(out / "model.safetensors"))


def assert_same_state(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name, want in expected.items():
        assert actual[name].dtype == want.dtype, name
        assert torch.equal(actual[name], want), name


def assert_statistics(doc, paths, base, tasks, *, r, alpha, saturation, lambdas):
    """ram_statistics.json against the reference's whole-model counts."""
    n = len(tasks)
    C, S, U, hist = reference.csu(reference.counts(base, tasks, EPSILON), n)
    settings = [doc[k] for k in ("epsilon", "r", "alpha", "saturation", "statistics")]
    assert settings == [EPSILON, r, alpha, saturation, "global"]
    elements = sum(t.numel() for t in base.values())
    assert (doc["num_tensors"], doc["num_elements"]) == (len(base), elements)
    assert isinstance(doc["seconds"], (int, float)) and doc["seconds"] >= 0
    rows = {row["model"]: row for row in doc["tasks"]}
    assert sorted(rows) == sorted(paths)
    for t, path in enumerate(paths):
        row = rows[path]
        counts = [row[k] for k in ("changed", "shared", "unique", "overlap_histogram")]
        assert counts == [C[t], S[t], U[t], hist[t]] and row["elements"] == elements
        rho = S[t] / U[t] if U[t] else (None if S[t] else 0)
        assert row["rho"] == (rho and pytest.approx(rho, rel=1e-12)), path
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


def checked(family, tmp_path, rule="clip", **options):
    """Global RAM+ CASES[rule] of `family`, checked by `assert_reference`;
    returns the base, the tasks, the merged state, the document and λ."""
    out = run_case(family, tmp_path / "out", rule, **options)
    base, tasks = family.state("base"), family.task_states()
    return (base, tasks, *assert_reference(family, out, CASES[rule], base, tasks))


def differs(state, other) -> bool:
    return any(not torch.equal(state[k], other[k]) for k in other)


def task_rows(doc) -> dict:
    return {row["model"]: row for row in doc["tasks"]}


CASES = {"clip": dict(r=0.3, alpha=1.0, saturation="clip")}
CASES["soft"] = dict(r=0.25, alpha=spec_default("alpha"), saturation="soft")


def written(settings: dict) -> dict:
    """The YAML parameters for a case: the soft rule has no alpha to write
    (it is refused there); the reference still takes the default."""
    soft = settings.get("saturation") == "soft"
    return {k: v for k, v in settings.items() if not (soft and k == "alpha")}


@pytest.mark.parametrize("rule", sorted(CASES))
@pytest.mark.parametrize("dtype, name", [("float32", "f32"), ("bfloat16", "bf16")])
def test_global_ramplus_equals_reference(rule, dtype, name, request, tmp_path):
    family = request.getfixturevalue(f"family_{name}")
    base, tasks, merged, _, lambdas = checked(family, tmp_path, rule)
    assert all(t.dtype == getattr(torch, dtype) for t in base.values())
    assert all(lam > 1 for lam in lambdas)
    # The family is built so that tensor-local statistics would give another
    # model: the global scope is what was computed.
    tensor_scope, _ = reference.merge(base, tasks, statistics="tensor", **CASES[rule])
    assert differs(tensor_scope, merged)


def test_tied_embeddings_counted_once(model_family, tmp_path):
    family = model_family("tied", tie=True, seed=2)
    base, tasks, merged, _, lambdas = checked(family, tmp_path)
    assert "lm_head.weight" not in base and "model.embed_tokens.weight" in base
    assert "lm_head.weight" not in merged

    # Counting the shared matrix a second time (as lm_head) changes λ here,
    # so the test would notice a double count.
    doubled = [{**t, "lm_head.weight": t["model.embed_tokens.weight"]} for t in tasks]
    head = {**base, "lm_head.weight": base["model.embed_tokens.weight"]}
    assert reference.merge(head, doubled, **CASES["clip"])[1] != lambdas


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
    tasks = [TaskSpec("wide", density=0.1, words=base_words + extra)]
    tasks += [TaskSpec("shuffled", density=0.2, words=shuffled)]
    family = model_family("union", tasks + [TaskSpec("same", 0.3)], vocab=40, seed=3)
    out = run_case(family, tmp_path / "out", tokenizer_source="union")

    vocab = AutoTokenizer.from_pretrained(str(out)).get_vocab()
    assert sorted(vocab) == sorted(base_words + extra)
    assert read_json(out / "config.json")["vocab_size"] == len(vocab)
    order = sorted(vocab, key=vocab.get)
    assert order[: len(base_words)] == list(base_words)

    def permuted(name):
        """Its rows in the union order; a word it lacks: the row of 'wide'."""
        state, donor = family.state(name), family.state("wide")
        row = {w: (donor, i) for i, w in enumerate(family.words["wide"])}
        row |= {w: (state, i) for i, w in enumerate(family.words[name])}
        for key in ("model.embed_tokens.weight", "lm_head.weight"):
            state[key] = torch.stack([s[key][i] for s, i in map(row.get, order)])
        return state

    base = permuted("base")
    tasks = [permuted(n) for n in family.tasks]
    assert base["model.embed_tokens.weight"].shape[0] == len(order)
    _, doc, _ = assert_reference(family, out, CASES["clip"], base, tasks)

    # Without the permutation the shuffled model would look changed almost
    # everywhere in its vocabulary rows.
    raw = reference.counts(family.state("base"), [family.state("shuffled")], EPSILON)
    raw_changed = reference.csu(raw, 1)[0][0]
    assert task_rows(doc)[family.paths["shuffled"]]["changed"] < raw_changed


@pytest.fixture(scope="module")
def edge_family(model_family):
    tasks = [TaskSpec("wide", 0.2), TaskSpec("narrow", 0.1)]
    tasks += [TaskSpec("inside", subset_of="wide"), TaskSpec("copy", identical=True)]
    return model_family("edge", tasks, seed=4)


@pytest.mark.parametrize("rule", sorted(CASES))
def test_no_unique_and_identical_task(rule, edge_family, tmp_path):
    family, settings = edge_family, CASES[rule]
    base, tasks, merged, doc, _ = checked(family, tmp_path, rule)
    rows = task_rows(doc)
    inside = rows[family.paths["inside"]]
    assert inside["changed"] == inside["shared"] > 0 and inside["unique"] == 0
    cap = settings["alpha"] if settings["saturation"] == "clip" else 1.0
    assert inside["rho"] is None
    assert inside["scale"] == pytest.approx(1 + settings["r"] * cap, rel=1e-12)
    copy = rows[family.paths["copy"]]
    assert copy["changed"] == copy["shared"] == copy["unique"] == copy["rho"] == 0
    assert copy["overlap_histogram"] == [0] * len(tasks) and copy["scale"] == 1.0

    # λ of the task with no unique element is never applied: any value of it
    # gives the same model.
    changed_scale, _ = reference.merge(
        base, tasks, unique_scale=[None, None, 5.0, None], **settings
    )
    assert_same_state(changed_scale, merged)


def test_single_task_model(family_f32, tmp_path):
    family, settings, name = family_f32, CASES["clip"], family_f32.tasks[1]
    out = run_case(family, tmp_path / "out", tasks=[name])
    base, task = family.state("base"), family.state(name)
    expected, lambdas = reference.merge(base, [task], **settings)
    assert lambdas == [1.0]
    assert_same_state(merged_state(out), expected)
    # Unique elements are kept as they are: the task model minus its
    # sub-threshold changes, i.e. the task model itself here.
    assert_same_state(merged_state(out), task)
    (row,) = read_json(out / STATISTICS_FILE)["tasks"]
    assert row["changed"] == row["unique"] > 0
    assert row["shared"] == 0 and row["rho"] == 0 and row["scale"] == 1.0


def assert_local_section(card, family, base, tasks, settings) -> None:
    """The card of a tensor-local merge has its statistics
    section: each agent's counts over the whole model, and the smallest and
    largest λ a tensor gave it, as the dense reference computes them."""
    section = card.split("### RAM+ statistics (tensor-local)")[1]
    lines = [x.strip("|").split("|") for x in section.splitlines() if x[:3] == "| /"]
    rows = {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in lines}
    per_tensor = reference.counts(base, tasks, 1e-5)
    C, S, U, _ = reference.csu(per_tensor, len(tasks))
    elements = sum(t.numel() for t in base.values())
    rule = (settings["r"], settings["alpha"], "clip")
    local = [reference.csu({k: v}, len(tasks)) for k, v in per_tensor.items()]
    lams = [
        [reference.lam(c[t], s[t], u[t], *rule) for t in range(len(tasks))]
        for c, s, u, _ in local
    ]
    for t, name in enumerate(family.tasks):
        changed, unique, shared, _rho, lam, _survives = rows[family.paths[name]]
        assert changed == f"{100 * C[t] / elements:.2f} %"
        assert unique == f"{100 * U[t] / C[t]:.2f} %"
        assert shared == f"{100 * S[t] / C[t]:.2f} %"
        low, high = (f(lam_t[t] for lam_t in lams) for f in (min, max))
        assert lam == f"{low:.4f}–{high:.4f}"


def test_tensor_scope_writes_no_statistics_file(family_f32, tmp_path):
    family, settings = family_f32, CASES["clip"]
    text = family.yaml("ramplus", parameters={**settings, "statistics": "tensor"})
    out = run(text, tmp_path / "out")
    assert not (out / STATISTICS_FILE).exists()
    base, tasks = family.state("base"), family.task_states()
    card = (out / "README.md").read_text(encoding="utf-8")
    assert_local_section(card, family, base, tasks, settings)
    expected, _ = reference.merge(base, tasks, statistics="tensor", **settings)
    merged = merged_state(out)
    assert_same_state(merged, expected)
    assert differs(reference.merge(base, tasks, **settings)[0], merged)
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
    base, tasks = family.state("base"), family.task_states()
    merged = merged_state(out)
    expected, _ = reference.merge(base, tasks, r=0.0)
    assert_same_state(merged, expected)

    # Stock mergekit's RAM on the same float32 inputs.
    models = {"base": base, **{f"t{i}": t for i, t in enumerate(tasks)}}
    assert_same_state(merge_state_dicts(models, stock_ram, base="base"), merged)
    # ... which ramplus (r > 0) is not.
    assert differs(reference.merge(base, tasks, r=0.1)[0], merged)


@pytest.mark.parametrize("given", [[1.5, 1.25, 2.0], [1.75, None, None]])
def test_explicit_unique_scale_writes_no_statistics_or_counts_the_rest(
    given, family_f32, tmp_path
):
    family, settings = family_f32, CASES["soft"]
    explicit = {n: {"unique_scale": s} for n, s in zip(family.tasks, given) if s}
    out = run_case(family, tmp_path / "out", "soft", model_parameters=explicit)
    base, tasks = family.state("base"), family.task_states()
    expected, lambdas = reference.merge(base, tasks, unique_scale=given, **settings)
    assert_same_state(merged_state(out), expected)
    if None not in given:
        assert not (out / STATISTICS_FILE).exists()
        return
    rows = task_rows(read_json(out / STATISTICS_FILE))
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
    for key in ("r", "alpha", "saturation"):
        assert doc[key] == spec_default(key), key
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "### RAM+ statistics" in card and STATISTICS_FILE in card
    section = card.split("### RAM+ statistics", 1)[1]
    for row in doc["tasks"]:
        start = f"| {row['model']} |"
        line = next(x for x in section.splitlines() if x.startswith(start))
        assert f"{row['scale']:.4f}" in line
        if row["rho"] is not None:
            assert f"{row['rho']:.4f}" in line

    # With config_source, mergekit_config.yml is that text verbatim.
    out2 = tmp_path / "out2"
    source = "# my recipe\n" + text
    config = MergeConfiguration.model_validate(yaml.safe_load(text))
    mergekit_ram.run_merge(config, str(out2), MergeOptions(quiet=True), source)
    assert (out2 / "mergekit_config.yml").read_text(encoding="utf-8") == source
    weights = (out / "model.safetensors").read_bytes()
    assert (out2 / "model.safetensors").read_bytes() == weights
