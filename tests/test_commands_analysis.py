"""`mergekit-ram analyze` and `merge --report` against the dense reference.

The models are tiny Llama checkpoints built with mergekit_ram.commands.synthetic
(bf16, sparse agents with overlapping supports). Every count in the report is
recomputed densely by tests/reference.py from the saved safetensors.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import reference
import torch
import yaml
from click.testing import CliRunner
from conftest import TaskSpec
from safetensors.torch import load_file, save_file
from test_analysis_regime import dense_merges, dense_retention

import mergekit_ram.integration.statistics
from mergekit_ram.analysis.render import unique_share_notes
from mergekit_ram.analysis.report import PAPER_R, SCHEMA_VERSION, layer_of
from mergekit_ram.analysis.verdict import NESTED, OVERLAPPING
from mergekit_ram.commands.analysis import analyze_config
from mergekit_ram.commands.cli import main
from mergekit_ram.commands.report_files import REPORT_JSON
from mergekit_ram.commands.synthetic import AgentSpec, build_models, merge_yaml
from mergekit_ram.core.naming import MODULES, module_of

EPSILON = 1e-5
DENSITIES = {"coder": 0.04, "tools": 0.3, "memory": 0.5, "search": 0.15}
AGENTS = [AgentSpec(name, density) for name, density in DENSITIES.items()]
NAMES = [a.name for a in AGENTS]
METHODS = ["ram", "ramplus", "ta_mean", "ta_sum"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze-models")
    paths = build_models(str(root / "models"), AGENTS, seed=3)
    return root, paths


def write_config(root: Path, paths: dict, method: str, **parameters) -> str:
    text = merge_yaml(paths, method, **parameters)
    path = root / f"{method}-{abs(hash(text))}.yml"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def dense(models):
    """Per-tensor (τ, m, c) and the base state, from the saved files."""
    _root, paths = models

    def state(name):
        return load_file(os.path.join(paths[name], "model.safetensors"))

    base = state("base")
    tasks = [state(n) for n in NAMES]

    def counts(epsilon=EPSILON):
        return reference.counts(base, tasks, epsilon)

    return base, tasks, counts


def invoke(*args, expect=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == expect, result.output
    return result.output


def read(path) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


SURVIVAL = ("rescaled", "rescale_survived")


def comparable(document: dict) -> dict:
    """A report or ram_statistics.json without its timing and what only a
    merge knows: how much of λ survived the written dtype (analyze: null)."""
    tasks = [{k: t[k] for k in t if k not in SURVIVAL} for t in document["tasks"]]
    drop = {"seconds", "written_dtypes"}
    return {k: v for k, v in document.items() if k not in drop} | {"tasks": tasks}


@pytest.fixture(scope="module")
def analyzed(models, tmp_path_factory):
    """`mergekit-ram analyze` on the ramplus config, with --out and an r sweep."""
    root, paths = models
    config = write_config(root, paths, "ramplus", r=0.1, alpha=2.0)
    out = tmp_path_factory.mktemp("analyze-out")
    output = invoke(
        "analyze", config, "--out", out, "--quiet", "--r", "0, 0.05,0.1,0.2"
    )
    return config, out, output, read(out / REPORT_JSON)


@pytest.fixture(scope="module")
def merged(models, tmp_path_factory):
    """`mergekit-ram merge --report` on the ramplus config: (its
    ram_statistics.json, its report.json)."""
    root, paths = models
    out = tmp_path_factory.mktemp("merge-report")
    config = write_config(root, paths, "ramplus")
    invoke("merge", config, out / "merged", "--report", out / "report", "--quiet")
    statistics = read(out / "merged" / "ram_statistics.json")
    return statistics, read(out / "report" / REPORT_JSON)


def test_counts_and_scales_equal_dense_reference(analyzed, dense):
    _config, _out, output, report = analyzed
    base, _tasks, counts = dense
    per_tensor = counts()
    n = len(NAMES)
    C, S, U, hist = reference.csu(per_tensor, n)
    assert report["num_tensors"] == len(base)
    assert report["num_elements"] == sum(t.numel() for t in base.values())
    assert [t["label"] for t in report["tasks"]] == NAMES
    for i, task in enumerate(report["tasks"]):
        assert (task["changed"], task["shared"], task["unique"]) == (C[i], S[i], U[i])
        assert task["overlap_histogram"] == hist[i]
        assert task["elements"] == report["num_elements"]
        assert task["rho"] == pytest.approx(S[i] / U[i], rel=1e-12)
        lam = reference.lam(C[i], S[i], U[i], 0.1, 2.0, "clip")
        assert task["scale"] == pytest.approx(lam, rel=1e-12)
        assert task["scale_explicit"] is False
    # The agents overlap in every way: unique, 2-, 3- and 4-way shared.
    assert all(all(v > 0 for v in h) for h in hist[1:])

    inter = reference.intersections(per_tensor, n)
    assert report["pairwise"]["models"] == [t["model"] for t in report["tasks"]]
    assert report["pairwise"]["intersection"] == inter
    assert [inter[i][i] for i in range(n)] == C
    expected = reference.jaccard(inter)
    for row, ref_row in zip(report["pairwise"]["jaccard"], expected):
        assert row == pytest.approx(ref_row, rel=1e-12)
    assert len({round(v, 6) for row in expected for v in row}) > n  # not uniform
    # Tensor-local λ: from each tensor where the task has unique elements.
    for i, task in enumerate(report["tasks"]):
        found = []  # (λ, elements, unique) in each tensor where the task has unique
        for name, entry in per_tensor.items():
            c, s, u, _ = reference.csu({name: entry}, n)
            if u[i] > 0:
                lam = reference.lam(c[i], s[i], u[i], 0.1, 2.0, "clip")
                found.append((lam, base[name].numel(), u[i]))
        lam, elements, unique = (np.array(v, dtype=float) for v in zip(*found))
        mean, weighted = lam @ elements / elements.sum(), lam @ unique / unique.sum()
        want = dict(mean=mean, unique_weighted_mean=weighted, min=lam.min())
        want |= dict(max=lam.max(), tensors=len(found))
        assert task["scale_tensor_local"] == pytest.approx(want)
    # Global and tensor-local λ differ: the reason to show both.
    assert any(
        abs(t["scale"] - t["scale_tensor_local"]["unique_weighted_mean"]) > 1e-3
        for t in report["tasks"]
    )
    # The r sweep (--r 0, .05,0.1,.2), its table in order.
    assert [s["r"] for s in report["sweep"]] == [0.0, 0.05, 0.1, 0.2]
    for entry in report["sweep"]:
        for i, task in enumerate(report["tasks"]):
            lam = reference.lam(C[i], S[i], U[i], entry["r"], 2.0, "clip")
            assert entry["scale"][task["model"]] == pytest.approx(lam, rel=1e-12)
    zero = report["sweep"][0]
    assert set(zero["scale"].values()) == {1.0}
    assert set(zero["scale_tensor_local"].values()) == {1.0}
    section = output.split("## λ sweep over r")[1].splitlines()
    rows = [line.split("|")[1].strip() for line in section[4:8]]
    assert rows == ["0", "0.05", "0.1", "0.2"]
    # λ grows with r for a task that has shared elements.
    lams = [s["scale"][report["tasks"][1]["model"]] for s in report["sweep"]]
    assert lams == sorted(lams) and lams[0] < lams[-1]


def test_per_layer_and_per_module_equal_dense_reference(analyzed, dense):
    _config, _out, _output, report = analyzed
    base, _tasks, counts = dense
    per_tensor = counts()
    layers = sorted(
        {int(k.split(".")[2]) for k in base if k.startswith("model.layers.")}
    )
    assert [e["layer"] for e in report["per_layer"]] == layers
    patterns = {
        "embeddings": r"embed_tokens",
        "attention": r"self_attn\.[qkvo]_proj",
        "mlp": r"mlp\.(up|down|gate)_proj",
        "norms": r"norm",
        "lm_head": r"lm_head",
    }
    assert [e["module"] for e in report["per_module"]] == list(patterns)
    assert sum(e["tensors"] for e in report["per_module"]) == len(base)
    groups = [(e, rf"^model\.layers\.{e['layer']}\.") for e in report["per_layer"]]
    groups += [(e, patterns[e["module"]]) for e in report["per_module"]]
    for entry, pattern in groups:
        names = [k for k in base if re.search(pattern, k)]
        C, S, U, _ = reference.csu({k: per_tensor[k] for k in names}, len(NAMES))
        assert entry["tensors"] == len(names)
        assert entry["elements"] == sum(base[k].numel() for k in names)
        got = [(t["changed"], t["shared"], t["unique"]) for t in entry["tasks"]]
        assert got == list(zip(C, S, U))
    # Density profile differs between layers (synthetic skew).
    first, second = ([t["changed"] for t in e["tasks"]] for e in report["per_layer"])
    assert first != second


def dense_expectations(per_tensor, n):
    """Per-tensor independence: E[s][t] = Σ n·d_s·d_t (diagonal Σ n·d_t) and
    Σ n·d_t·Π_{s≠t}(1 − d_s), the expected unique elements."""
    expected, alone = np.zeros((n, n)), np.zeros(n)
    for _tau, m, _c in per_tensor.values():
        elements = m[0].numel()
        d = np.array([float(m[t].sum()) for t in range(n)]) / elements
        expected += elements * (np.outer(d, d) + np.diag(d - d * d))
        alone += [elements * d[t] * np.prod(np.delete(1 - d, t)) for t in range(n)]
    return expected, alone


def test_regime_equals_dense_reference(analyzed, dense):
    _config, _out, output, report = analyzed
    base, tasks, counts = dense
    per_tensor = counts()
    n = len(NAMES)
    inter = np.array(reference.intersections(per_tensor, n), dtype=float)
    expected, alone = dense_expectations(per_tensor, n)
    pair, C = report["pairwise"], np.diag(inter)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-9)
    close(pair["expected_intersection"], expected)
    close(pair["lift"], inter / expected)
    close(pair["expected_jaccard"], expected / (C[:, None] + C[None, :] - expected))
    # The expectation is per tensor: whole-model densities give another one.
    whole = np.outer(C, C) / report["num_elements"]
    assert (abs(expected - whole) > 0.01 * expected)[~np.eye(n, dtype=bool)].any()
    shares = [[t[k] for t in report["tasks"]] for k in ("unique_share", "unique")]
    close(shares[0], np.array(shares[1]) / C)
    close([t["expected_unique_share"] for t in report["tasks"]], alone / C)
    merged = dense_merges(base, tasks, EPSILON, r=0.1, alpha=2.0)
    for method, vector in merged.items():
        want = dense_retention(base, tasks, vector)
        got = [t["retention"][method] for t in report["tasks"]]
        assert got == pytest.approx(want, rel=1e-4), method
    plus = dict(r=0.1, alpha=2.0, saturation="clip", statistics="global")
    assert report["retention"]["ramplus"] == plus
    assert report["retention"]["ta_mean_weight"] == pytest.approx(1 / n)
    first = report["tasks"][0]
    assert f"{first['retention']['ramplus']:.3f}" in output
    assert f"{pair['lift'][0][1]:.2f}" in output


@pytest.mark.parametrize("variant", ["ram", "tensor-explicit"])
def test_retention_follows_the_configuration(models, dense, tmp_path, variant):
    root, paths = models
    base, tasks, _counts = dense
    config = yaml.safe_load(merge_yaml(paths, "ramplus"))
    if variant == "ram":
        # r = 0: RAM+ would be RAM, so retention shows the paper's r.
        config["merge_method"] = "ram"
        options = dict(r=PAPER_R, alpha=2.0)
    else:
        config["parameters"] = {"statistics": "tensor", "saturation": "soft"}
        config["models"][0]["parameters"] = {"unique_scale": 1.5}
        options = dict(r=0.1, saturation="soft", statistics="tensor")
        options["unique_scale"] = [1.5, None, None, None]
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    invoke("analyze", path, "--out", tmp_path / "out", "--quiet")
    report = read(tmp_path / "out" / "report.json")
    want = dense_retention(
        base, tasks, dense_merges(base, tasks, EPSILON, **options)["ramplus"]
    )
    got = [t["retention"]["ramplus"] for t in report["tasks"]]
    assert got == pytest.approx(want, rel=1e-4)
    assert report["retention"]["ramplus"]["r"] == options["r"]
    if variant != "ram":  # the explicit λ is reported as such
        first, *rest = report["tasks"]
        assert first["scale"] == 1.5 and first["scale_explicit"] is True
        assert first["scale_tensor_local"]["min"] == 1.5
        assert not any(t["scale_explicit"] for t in rest)


def test_integer_only_models_are_one_error(tmp_path):
    paths = build_models(str(tmp_path / "models"), AGENTS[:2], seed=5)
    for path in paths.values():
        file = os.path.join(path, "model.safetensors")
        state = load_file(file)
        save_file(
            {k: (v.float() * 100).to(torch.int32) for k, v in state.items()}, file
        )
    config = tmp_path / "int.yml"
    config.write_text(merge_yaml(paths, "ramplus"), encoding="utf-8")
    output = invoke("analyze", config, "--out", tmp_path / "out", "--quiet", expect=2)
    assert output.startswith("Error: Nothing to analyse")
    assert "floating point" in output and paths["base"] in output
    assert len(output.strip().splitlines()) == 1
    assert "Traceback" not in output and "Task vectors of" not in output
    assert not (tmp_path / "out").exists()


def test_report_json_schema(analyzed, merged):
    """What docs/report_schema.md's tables leave unsaid: sizes, ranges, the
    verdict's references, and the fields only a merge counts."""
    _config, _out, _output, report = analyzed
    assert report["schema_version"] == SCHEMA_VERSION == 1
    n = len(report["tasks"])
    for task in report["tasks"]:
        assert len(task["overlap_histogram"]) == n
        assert list(task["retention"]) == METHODS
    pair = report["pairwise"]
    for key in set(pair) - {"models"}:
        assert len(pair[key]) == n and all(len(row) == n for row in pair[key])
    for key in ("jaccard", "expected_jaccard"):
        assert all(0.0 <= v <= 1.0 for row in pair[key] for v in row)
    assert report["retention"]["methods"] == METHODS
    verdict = report["verdict"]
    assert verdict["supports"] in {"independent", "overlapping", "nested", "disjoint"}
    assert set(verdict["diluted"]) <= {t["model"] for t in report["tasks"]}
    assert len(verdict["pairs"]) == n * (n - 1) // 2
    assert all(0.0 <= entry["inside"] <= 1.0 for entry in verdict["pairs"])
    assert {e["module"] for e in report["per_module"]} <= set(MODULES)
    # ram_statistics.json's fields are report fields with the same values;
    # only a merge counts λ's survival (analyze: null, merge --report: counts).
    statistics, merge_report = merged
    for ours, theirs in zip(report["tasks"], comparable(statistics)["tasks"]):
        assert {k: ours[k] for k in theirs} == theirs
    assert report["written_dtypes"] is None
    assert all(t[k] is None for t in report["tasks"] for k in SURVIVAL)
    for key in SURVIVAL:
        assert [t[key] for t in merge_report["tasks"]] == [
            t[key] for t in statistics["tasks"]
        ]
    assert merge_report["written_dtypes"] == statistics["written_dtypes"]
    assert sum(t["rescaled"] for t in statistics["tasks"]) > 0


SCHEMA = Path(__file__).parent.parent / "docs" / "report_schema.md"


def schema_tables() -> tuple[dict[str, dict[str, str]], dict[str, set[str]]]:
    """docs/report_schema.md's tables: report.json's {object path: {field:
    type}} ("" the top level, `tasks[]` each element of `tasks`) and
    ram_statistics.json's {object path: fields}."""
    report: dict[str, dict[str, str]] = {}
    statistics: dict[str, set[str]] = {}
    header = None
    for line in SCHEMA.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        names = re.findall(r"`([^`]+)`", cells[0])
        if header is None:
            header = cells[0]
        elif set(cells[0]) <= set("-"):
            continue
        elif header == "object":
            path = names[0] if names else ""
            statistics[path] = set(re.findall(r"`([^`]+)`", cells[1]))
        elif header.startswith("field"):
            paths = re.findall(r"`([^`]+)`", header) or [""]
            pairs = zip(paths, names) if len(names) == len(paths) > 1 else None
            for path, name in pairs or ((p, n) for p in paths for n in names):
                report.setdefault(path, {})[name] = cells[1]
    return report, statistics


TYPES = {"int": int, "float": (float, int), "str": str, "bool": bool}
TYPES |= {"list": list, "object": dict, "null": type(None)}


def has_type(value, documented: str) -> bool:
    """Whether `value` has the type a schema table gives (`list[int] or
    null`: a list or null); every float may be null (strict JSON)."""
    if not documented:
        return True  # an undocumented field: the field sets are compared apart
    words = re.findall(r"\w+", re.sub(r"\[.*\]|\(.*\)", "", documented))
    kinds = [TYPES[w] for w in words if w in TYPES]
    kinds += [type(None)] if "float" in words else []
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, tuple(kinds))


def object_fields(value, tables, path="", found=None) -> dict[str, set[str]]:
    """Every object's fields in a real document, by path as in schema_tables,
    each value checked against its documented type; an object documented as a
    map (`object (model → ...)`) is a value."""
    found = {} if found is None else found
    if isinstance(value, dict):
        found.setdefault(path, set()).update(value)
        for key, item in value.items():
            documented = tables.get(path, {}).get(key, "")
            assert has_type(item, documented), (path, key, documented, item)
            if "→" not in documented:
                object_fields(item, tables, f"{path}.{key}".lstrip("."), found)
    elif isinstance(value, list):
        for item in value:
            object_fields(item, tables, f"{path}[]", found)
    return found


def test_schema_document_matches_real_files(analyzed, merged):
    tables, statistics_tables = schema_tables()
    documented = {path: set(fields) for path, fields in tables.items()}
    assert {"", "tasks[]", "retention.ramplus", "per_layer[].tasks[]"} <= set(
        documented
    )
    # analyze's report (with an r sweep) has every object of the schema, its
    # top-level fields in the documented order.
    assert object_fields(analyzed[3], tables) == documented
    assert list(analyzed[3]) == list(tables[""])
    statistics, merge_report = merged
    for path, fields in object_fields(merge_report, tables).items():
        assert fields == documented[path], path
    assert object_fields(statistics, tables) == statistics_tables
    for path, fields in statistics_tables.items():
        assert fields <= documented[path], path


def test_cli_output_and_files(analyzed):
    _config, out, output, report = analyzed
    titles = ["Per task", "k-way overlap", "Per module"]
    titles += ["Per layer", "λ sweep over r", "Overlap against independent supports"]
    titles += ["Unique share and retention"]
    assert all(f"\n## {title}\n" in output for title in titles)
    modules = ["embeddings", "attention", "mlp", "norms", "lm_head"]
    assert all(name in output for name in NAMES + modules)
    first = report["tasks"][0]
    assert f"{first['changed']:,}" in output and f"{first['scale']:.4f}" in output
    # One rendering: report.md is what the terminal showed, with the figures.
    md = (out / "report.md").read_text(encoding="utf-8")
    assert output.startswith(md.split("\n## Figures\n")[0])
    assert re.search(r"\n\| task +\| changed % \|", md)  # columns, padded


def test_cli_writes_the_figures(analyzed):
    pytest.importorskip(
        "matplotlib", reason="figures need the plots extra (mergekit-ram[plots])"
    )
    _config, out, output, _report = analyzed
    names = ["report.json", "report.md", *analyze_figures()]
    assert f"Report written to {out}: {', '.join(names)}\n" in output
    for name in names:
        assert (out / name).stat().st_size > 0, name
    md = (out / "report.md").read_text(encoding="utf-8")
    assert all(f"![{name[:-4]}]({name})" in md for name in analyze_figures())
    assert "pip install" not in output + md


def analyze_figures():
    from mergekit_ram.analysis.figures import FIGURES

    return list(FIGURES)


@pytest.mark.parametrize("bad", ["-0.1", "abc", ",", "nan", "inf", ""])
def test_bad_r_values_refused(analyzed, bad):
    config = analyzed[0]
    output = invoke("analyze", config, "--r", bad, expect=2)
    assert "--r" in output


def test_epsilon_override_is_monotone(models, dense):
    root, paths = models
    config = write_config(root, paths, "ramplus")
    _base, _tasks, counts = dense
    changed = []
    for epsilon in (1e-5, 1e-3, 1e-2, 3e-2):
        out = root / f"eps-{epsilon}"
        output = invoke(
            "analyze", config, "--epsilon", epsilon, "--quiet", "--out", out
        )
        assert f"epsilon = {epsilon:g}" in output
        report = read(out / "report.json")
        assert report["epsilon"] == epsilon
        C, S, U, hist = reference.csu(counts(epsilon), len(NAMES))
        assert [t["changed"] for t in report["tasks"]] == C
        assert [t["overlap_histogram"] for t in report["tasks"]] == hist
        changed.append(C)
    for before, after in zip(changed, changed[1:]):
        assert all(a <= b for a, b in zip(after, before))
    assert changed[-1] != changed[0] and sum(changed[-1]) < sum(changed[0])


@pytest.fixture
def pass_counter(monkeypatch):
    """Counts calls of the statistics engine's collect_planned, wherever imported."""
    calls = []
    original = mergekit_ram.integration.statistics.collect_planned

    def counting(*args, **kwargs):
        calls.append(kwargs.get("desc"))
        return original(*args, **kwargs)

    monkeypatch.setattr(
        mergekit_ram.integration.statistics, "collect_planned", counting
    )
    return calls


@pytest.mark.parametrize(
    ("method", "said"),
    [
        ("ramplus", "no extra pass"),  # the report from the merge's own pass
        ("ram", "needed no whole-model statistics pass"),  # RAM: one for the report
    ],
)
def test_merge_report_equals_analyze(models, tmp_path, pass_counter, method, said):
    root, paths = models
    config = write_config(root, paths, method)
    merge = ("merge", config, tmp_path / "merged", "--report", tmp_path / "rep")
    output = invoke(*merge, "--quiet")
    assert len(pass_counter) == 1  # one pass for the merge and its report
    assert said in output and "## Per task" in output
    assert (tmp_path / "merged" / "model.safetensors").exists()
    report = read(tmp_path / "rep" / "report.json")
    invoke("analyze", config, "--out", tmp_path / "ana", "--quiet")
    assert len(pass_counter) == 2  # analyze: one pass, the hook did not run one
    assert comparable(report) == comparable(read(tmp_path / "ana" / "report.json"))
    assert sorted(os.listdir(tmp_path / "rep")) == sorted(os.listdir(tmp_path / "ana"))
    statistics = tmp_path / "merged" / "ram_statistics.json"
    if method == "ramplus":
        tasks = read(statistics)["tasks"]
        assert tasks == [{k: t[k] for k in tasks[0]} for t in report["tasks"]]
    else:
        assert not statistics.exists()
        assert report["r"] == 0 and all(t["scale"] == 1 for t in report["tasks"])
        # RAM: the report adds the paper's RAM+ r so the user sees its λ.
        assert [s["r"] for s in report["sweep"]] == [PAPER_R]


def test_other_merge_method_uses_paper_defaults(models, tmp_path, analyzed):
    root, paths = models
    config = yaml.safe_load(merge_yaml(paths, "della"))
    config["parameters"] = {"epsilon": 0.05, "density": 0.5}  # DELLA's, not ours
    for entry in config["models"]:
        entry["parameters"] = {"weight": 1.0}
    path = tmp_path / "della.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    output = invoke("analyze", path, "--out", tmp_path / "out", "--quiet")
    assert "paper's RAM+ defaults" in output
    report = read(tmp_path / "out" / "report.json")
    assert report["method"] == "della"
    assert (report["epsilon"], report["r"], report["alpha"]) == (1e-5, 0.1, 2.0)
    ours = analyzed[3]
    assert report["tasks"] == ours["tasks"]
    assert report["pairwise"] == ours["pairwise"]


def test_without_matplotlib_text_and_json_still_written(
    analyzed, tmp_path, monkeypatch
):
    config = analyzed[0]
    for name in [
        "matplotlib",
        *(n for n in sys.modules if n.startswith("matplotlib.")),
    ]:
        monkeypatch.setitem(sys.modules, name, None)
    output = invoke("analyze", config, "--out", tmp_path, "--quiet")
    assert "## Per task" in output
    assert sorted(os.listdir(tmp_path)) == ["report.json", "report.md"]
    assert read(tmp_path / "report.json")["tasks"] == analyzed[3]["tasks"]
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    hint = "pip install 'mergekit-ram[plots]'"
    assert hint in output and hint in md


def test_analyze_does_not_modify_the_config(models):
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    root, paths = models
    config = MergeConfiguration.model_validate(
        yaml.safe_load(merge_yaml(paths, "ramplus"))
    )
    before = config.model_dump()
    result = analyze_config(config, MergeOptions(quiet=True), epsilon=1e-4)
    assert config.model_dump() == before
    assert result.settings.epsilon == 1e-4 and result.stats.epsilon == 1e-4


@pytest.mark.parametrize(
    ("name", "module", "layer"),
    [
        ("model.embed_tokens.weight", "embeddings", None),
        ("lm_head.weight", "lm_head", None),
        ("model.norm.weight", "norms", None),
        ("model.layers.3.input_layernorm.weight", "norms", 3),
        ("model.layers.12.post_attention_layernorm.weight", "norms", 12),
        ("model.layers.0.self_attn.q_norm.weight", "norms", 0),
        ("model.layers.1.self_attn.k_proj.weight", "attention", 1),
        ("model.layers.1.self_attn.o_proj.bias", "attention", 1),
        ("model.layers.7.mlp.down_proj.weight", "mlp", 7),
        ("transformer.h.2.attn.c_attn.weight", "attention", 2),
        ("transformer.wte.weight", "embeddings", None),
        ("model.layers.2.mlp.experts.5.up_proj.weight", "mlp", 2),
        ("score.weight", "other", None),
    ],
)
def test_module_and_layer_of_names(name, module, layer):
    assert module_of(name) == module
    assert layer_of(name) == layer


# --- the verdict on agents built to each case ---------------------------------

CASES = {
    # Like the paper's agents: independent supports, one sparse agent whose
    # changes mostly land on elements a dense agent changes too.
    "independent": (
        TaskSpec("coder", density=0.03),
        TaskSpec("tools", density=0.45),
        TaskSpec("memory", density=0.55),
    ),
    # Two agents changing 60 % of a third's elements, plus a few of their own.
    "overlapping": (
        TaskSpec("alpha", density=0.3),
        TaskSpec("beta", subset_of="alpha", share=0.6, plus=0.08),
        TaskSpec("gamma", subset_of="alpha", share=0.6, plus=0.08),
    ),
    # One agent's changes are a subset of the other's.
    "nested": (TaskSpec("wide", density=0.3), TaskSpec("inner", subset_of="wide")),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, model_family, tmp_path_factory):
    """`mergekit-ram analyze --out` on one case: (case, family, output, report,
    report.md)."""
    family = model_family(f"verdict-{request.param}", CASES[request.param])
    root = tmp_path_factory.mktemp(f"verdict-{request.param}")
    config = root / "config.yml"
    config.write_text(family.yaml("ramplus"), encoding="utf-8")
    output = invoke("analyze", config, "--out", root / "report", "--quiet")
    markdown = (root / "report" / "report.md").read_text(encoding="utf-8")
    return request.param, family, output, read(root / "report" / REPORT_JSON), markdown


def flat(text: str) -> str:
    """Text with its line wrapping undone."""
    return " ".join(text.split())


def test_verdict_and_notes_say_which_case_and_which_agent(case):
    """The verdict, and the notes on unique share and lift only for the cases
    the numbers show."""
    name, family, output, report, markdown = case
    verdict, text = report["verdict"], flat(output)
    sentence = verdict["sentence"]
    assert f"**Verdict:** {sentence}" in text
    assert f"**Verdict:** {sentence}" in markdown
    assert verdict["supports"] == name
    assert sentence.startswith(f"supports {name} (")
    kept = {t["model"]: t["retention"]["ram"] for t in report["tasks"]}
    lift = [v for row in report["pairwise"]["lift"] for v in row]
    piled = "changes pile up on elements other tasks change too"
    if name == "independent":
        assert all(1 / OVERLAPPING < v < OVERLAPPING for v in lift)
        assert verdict["diluted"] == [family.paths["coder"]]
        assert "RAM would dilute coder (it keeps " in sentence
        assert "try `shared: ties`" in sentence
        assert piled not in text and f"lift ≥ {OVERLAPPING:g}" not in text
        assert "lift ≈ 1: independent supports" in text
    elif name == "overlapping":
        assert min(v for v in lift if v != 1.0) >= OVERLAPPING
        # All three keep about half, within a few percent of each other.
        assert set(verdict["diluted"]) == set(kept)
        assert verdict["diluted"][0] == min(kept, key=kept.__getitem__)
        assert "RAM would dilute every agent about equally" in sentence
        assert "try tuned task arithmetic / TIES / DARE" in sentence
        labels = [t["label"] for t in report["tasks"]]
        assert f"Far below expected for {', '.join(labels)}: their {piled}" in text
        assert f"lift ≥ {OVERLAPPING:g}: overlapping supports" in text
        assert "lift ≈ 1" not in text
    else:
        (pair,) = verdict["pairs"]
        assert pair["inside"] >= NESTED
        assert verdict["diluted"] == [family.paths["inner"]]
        assert "100 % of inner's changes lie inside wide's" in sentence
        assert "RAM would dilute inner (it keeps " in sentence
        assert "nested: at least 90 % of one agent's changes" in text


def test_unique_share_notes_name_only_the_tasks_far_from_expected():
    shares = {"a": (0.19, 0.188), "b": (0.1, 0.5), "c": (0.9, 0.5), "d": (None, None)}
    tasks = [
        dict(label=k, unique_share=observed, expected_unique_share=expected)
        for k, (observed, expected) in shares.items()
    ]
    assert unique_share_notes(tasks) == [
        "Far below expected for b: their changes pile up on elements other tasks "
        "change too.",
        "Far above expected for c: their changes avoid the elements other tasks "
        "change.",
    ]


def test_the_verdict_does_not_advise_the_shared_mode_in_use(model_family, tmp_path):
    """The independent case is told to try `shared: ties`
    (test_verdict_and_notes_say_which_case_and_which_agent); the same agents merged
    with `shared: ties` are told it is in use."""
    family = model_family("verdict-independent", CASES["independent"])
    config = tmp_path / "ties.yml"
    config.write_text(family.yaml("ramplus", parameters={"shared": "ties"}))
    invoke("analyze", config, "--out", tmp_path / "report", "--quiet")
    sentence = read(tmp_path / "report" / REPORT_JSON)["verdict"]["sentence"]
    assert "RAM would dilute coder" in sentence
    assert "try `shared: ties`" not in sentence
    assert "already uses `shared: ties`" in sentence


def test_a_report_never_replaces_a_file_it_did_not_write(models, tmp_path):
    """A user's own report.md in the --out / --report folder is refused before
    the analysis or the merge; an earlier report of ours is replaced."""
    root, paths = models
    config = write_config(root, paths, "ramplus", r=0.1)
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "report.md").write_text("my notes")
    for args in (
        ("analyze", config, "--out", folder),
        ("merge", config, tmp_path / "merged", "--report", folder),
    ):
        output = invoke(*args, "--quiet", expect=2)
        assert "holds report.md, which no mergekit-ram report wrote" in flat(output)
        assert (folder / "report.md").read_text() == "my notes"
    assert not (tmp_path / "merged").exists()
    (folder / "report.md").unlink()
    invoke("analyze", config, "--out", folder, "--quiet")
    invoke("analyze", config, "--out", folder, "--quiet")  # our own: replaced
    assert read(folder / REPORT_JSON)["verdict"]["sentence"]
    # Ours, but report.md a link to the user's notes, or report.json a FIFO
    # (reading it to recognise it would block): refused, nothing written.
    notes = tmp_path / "notes.md"
    notes.write_text("my notes")
    (folder / "report.md").unlink()
    (folder / "report.md").symlink_to(notes)
    invoke("analyze", config, "--out", folder, "--quiet", expect=2)
    assert notes.read_text() == "my notes"
    (folder / "report.md").unlink()
    (folder / REPORT_JSON).unlink()
    os.mkfifo(folder / REPORT_JSON)
    invoke("analyze", config, "--out", folder, "--quiet", expect=2)
