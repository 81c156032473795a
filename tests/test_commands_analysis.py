"""`mergekit-ram analyze` and `merge --report` against the dense reference.

The models are tiny Llama checkpoints built with mergekit_ram.commands.synthetic
(bf16, sparse agents with overlapping supports). Every count in the report is
recomputed densely by tests/reference.py from the saved safetensors. Figures
take seconds to draw: they are drawn only where a test looks at them (their
pixels are tests/test_analysis_figures.py's).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import reference
import yaml
from click.testing import CliRunner
from conftest import TaskSpec, read_json
from safetensors.torch import load_file, save_file
from test_analysis_regime import dense_merges, dense_retention

from mergekit_ram.analysis import figures
from mergekit_ram.analysis.render import unique_share_notes
from mergekit_ram.analysis.report import PAPER_R, SCHEMA_VERSION, layer_of
from mergekit_ram.analysis.verdict import NESTED, OVERLAPPING
from mergekit_ram.commands import analysis
from mergekit_ram.commands.cli import main
from mergekit_ram.commands.report_files import REPORT_JSON
from mergekit_ram.commands.synthetic import AgentSpec, build_models, merge_yaml
from mergekit_ram.core.naming import MODULES, module_of
from mergekit_ram.integration import statistics

EPSILON = 1e-5
DENSITIES = {"coder": 0.04, "tools": 0.3, "memory": 0.5, "search": 0.15}
AGENTS = [AgentSpec(name, density) for name, density in DENSITIES.items()]
NAMES = [a.name for a in AGENTS]
METHODS = ["ram", "ramplus", "ta_mean", "ta_sum"]
SURVIVAL = ("rescaled", "rescale_survived")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze-models")
    return root, build_models(str(root / "models"), AGENTS, seed=3)


def write_config(root: Path, paths: dict, method: str, first=None, **parameters):
    """A config file; `first`: the first model's parameters."""
    config = yaml.safe_load(merge_yaml(paths, method, **parameters))
    if first:
        config["models"][0]["parameters"] = first
    text = yaml.safe_dump(config)
    path = root / f"{method}-{abs(hash(text))}.yml"
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def dense(models):
    """The base and task states from the saved files, and their per-tensor
    (τ, m, c) at an epsilon."""
    _root, paths = models
    files = (os.path.join(paths[n], "model.safetensors") for n in ["base", *NAMES])
    base, *tasks = map(load_file, files)
    return base, tasks, functools.partial(reference.counts, base, tasks)


def invoke(*args, expect=0, drawn=False):
    """The command's output; figures only when `drawn`."""
    with pytest.MonkeyPatch.context() as patch:
        if not drawn:
            patch.setattr(figures, "write_figures", lambda report, folder: [])
        args = [str(a) for a in args]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == expect, result.output
    return result.output


def analyze(config, out, *args, **kwargs):
    """`mergekit-ram analyze config --out out --quiet *args`'s output."""
    return invoke("analyze", config, "--out", out, "--quiet", *args, **kwargs)


def assert_retention(report, dense, methods=METHODS, **plus):
    """Each task's retention under `methods` against the dense merges."""
    for method, vector in dense_merges(*dense[:2], EPSILON, **plus).items():
        got = [t["retention"][method] for t in report["tasks"]]
        want = dense_retention(*dense[:2], vector)
        assert method not in methods or got == pytest.approx(want, rel=1e-4), method


def flat(text: str) -> str:
    """Text with its line wrapping undone."""
    return " ".join(text.split())


def comparable(document: dict) -> dict:
    """A report or ram_statistics.json without its timing and what only a
    merge knows: how much of λ survived the written dtype (analyze: null)."""
    tasks = [{k: t[k] for k in t if k not in SURVIVAL} for t in document["tasks"]]
    drop = {"seconds", "written_dtypes"}
    return {k: v for k, v in document.items() if k not in drop} | {"tasks": tasks}


@pytest.fixture(scope="module")
def analyzed(models, tmp_path_factory):
    """`mergekit-ram analyze` on the ramplus config, with --out, the figures
    and an r sweep."""
    config = write_config(*models, "ramplus", r=0.1, alpha=2.0)
    out = tmp_path_factory.mktemp("analyze-out")
    output = analyze(config, out, "--r", "0, 0.05,0.1,0.2", drawn=True)
    return config, out, output, read_json(out / REPORT_JSON)


@pytest.fixture(scope="module")
def merged(models, tmp_path_factory):
    """`mergekit-ram merge --report` on the ramplus config: (its
    ram_statistics.json, its report.json)."""
    out = tmp_path_factory.mktemp("merge-report")
    config = write_config(*models, "ramplus")
    invoke("merge", config, out / "merged", "--report", out / "report", "--quiet")
    statistics = read_json(out / "merged" / "ram_statistics.json")
    return statistics, read_json(out / "report" / REPORT_JSON)


def test_counts_and_scales_equal_dense_reference(analyzed, dense):
    _config, _out, output, report = analyzed
    base, _tasks, counts = dense
    per_tensor = counts(EPSILON)
    n = len(NAMES)
    C, S, U, hist = reference.csu(per_tensor, n)
    sizes = (len(base), sum(t.numel() for t in base.values()))
    assert (report["num_tensors"], report["num_elements"]) == sizes
    assert [t["label"] for t in report["tasks"]] == NAMES
    for i, task in enumerate(report["tasks"]):
        assert (task["changed"], task["shared"], task["unique"]) == (C[i], S[i], U[i])
        assert task["overlap_histogram"] == hist[i]
        assert (task["elements"], task["scale_explicit"]) == (sizes[1], False)
        assert task["rho"] == pytest.approx(S[i] / U[i], rel=1e-12)
        lam = reference.lam(C[i], S[i], U[i], 0.1, 2.0, "clip")
        assert task["scale"] == pytest.approx(lam, rel=1e-12)
    # The agents overlap in every way: unique, 2-, 3- and 4-way shared.
    assert all(all(v > 0 for v in h) for h in hist[1:])

    inter = reference.intersections(per_tensor, n)
    assert report["pairwise"]["models"] == [t["model"] for t in report["tasks"]]
    assert report["pairwise"]["intersection"] == inter
    assert [inter[i][i] for i in range(n)] == C
    expected = reference.jaccard(inter)
    np.testing.assert_allclose(report["pairwise"]["jaccard"], expected, rtol=1e-12)
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
    local = [t["scale_tensor_local"]["unique_weighted_mean"] for t in report["tasks"]]
    assert max(abs(t["scale"] - v) for t, v in zip(report["tasks"], local)) > 1e-3
    # The r sweep (--r 0, .05,0.1,.2), its table in order.
    assert [s["r"] for s in report["sweep"]] == [0.0, 0.05, 0.1, 0.2]
    for entry in report["sweep"]:
        for i, task in enumerate(report["tasks"]):
            lam = reference.lam(C[i], S[i], U[i], entry["r"], 2.0, "clip")
            assert entry["scale"][task["model"]] == pytest.approx(lam, rel=1e-12)
    zero = report["sweep"][0]
    assert {*zero["scale"].values(), *zero["scale_tensor_local"].values()} == {1.0}
    section = output.split("## λ sweep over r")[1].splitlines()[4:8]
    assert [row.split("|")[1].strip() for row in section] == "0 0.05 0.1 0.2".split()
    # λ grows with r for a task that has shared elements.
    lams = [s["scale"][report["tasks"][1]["model"]] for s in report["sweep"]]
    assert lams == sorted(lams) and lams[0] < lams[-1]


def test_per_layer_and_per_module_equal_dense_reference(analyzed, dense):
    report = analyzed[3]
    base, _tasks, counts = dense
    per_tensor = counts(EPSILON)
    layers = {int(k.split(".")[2]) for k in base if k.startswith("model.layers.")}
    assert [e["layer"] for e in report["per_layer"]] == sorted(layers)
    patterns = {"embeddings": r"embed_tokens", "attention": r"self_attn\.[qkvo]_proj"}
    patterns |= dict(mlp=r"mlp\.(up|down|gate)_proj", norms="norm", lm_head="lm_head")
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


def test_regime_equals_dense_reference(analyzed, dense):
    """Per-tensor independence: E[s][t] = Σ n·d_s·d_t (diagonal Σ n·d_t) and
    Σ n·d_t·Π_{s≠t}(1 − d_s), the expected unique elements; retention against
    every method merged densely."""
    _config, _out, output, report = analyzed
    base, tasks, counts = dense
    per_tensor = counts(EPSILON)
    n = len(NAMES)
    expected, alone = np.zeros((n, n)), np.zeros(n)
    for _tau, m, _c in per_tensor.values():
        d = m.flatten(1).double().mean(1).numpy()
        expected += m[0].numel() * (np.outer(d, d) + np.diag(d - d * d))
        alone += [m[0].numel() * d[t] * np.prod(np.delete(1 - d, t)) for t in range(n)]
    inter = np.array(reference.intersections(per_tensor, n), dtype=float)
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
    assert_retention(report, dense, r=0.1)
    plus = dict(r=0.1, alpha=2.0, saturation="clip", statistics="global")
    assert report["retention"]["ramplus"] == plus
    assert report["retention"]["ta_mean_weight"] == pytest.approx(1 / n)
    assert f"{report['tasks'][0]['retention']['ramplus']:.3f}" in output
    assert f"{pair['lift'][0][1]:.2f}" in output


def test_integer_only_models_are_one_error(tmp_path):
    paths = build_models(str(tmp_path / "models"), AGENTS[:2], seed=5)
    for path in paths.values():
        file = os.path.join(path, "model.safetensors")
        save_file({k: (v * 100).int() for k, v in load_file(file).items()}, file)
    config = write_config(tmp_path, paths, "ramplus")
    output = analyze(config, tmp_path / "out", expect=2)
    assert output.startswith("Error: Nothing to analyse")
    assert "floating point" in output and paths["base"] in output
    assert len(output.strip().splitlines()) == 1
    assert "Traceback" not in output and "Task vectors of" not in output
    assert not (tmp_path / "out").exists()


def test_report_json_schema(analyzed, merged):
    """What docs/report_schema.md's tables leave unsaid: sizes, ranges, the
    verdict's references, and the fields only a merge counts."""
    report = analyzed[3]
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
        survived = [t[key] for t in statistics["tasks"]]
        assert [t[key] for t in merge_report["tasks"]] == survived
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
    return bool in kinds if isinstance(value, bool) else isinstance(value, tuple(kinds))


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
    objects = {"", "tasks[]", "retention.ramplus", "per_layer[].tasks[]"}
    assert objects <= set(documented)
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


def test_cli_output_files_and_figures(analyzed):
    _config, out, output, report = analyzed
    titles = ["Per task", "k-way overlap", "Per module", "Per layer", "λ sweep over r"]
    titles += ["Overlap against independent supports", "Unique share and retention"]
    assert all(f"\n## {title}\n" in output for title in titles)
    modules = ["embeddings", "attention", "mlp", "norms", "lm_head"]
    assert all(name in output for name in NAMES + modules)
    first = report["tasks"][0]
    assert f"{first['changed']:,}" in output and f"{first['scale']:.4f}" in output
    # One rendering: report.md is what the terminal showed, with the figures.
    md = (out / "report.md").read_text(encoding="utf-8")
    assert output.startswith(md.split("\n## Figures\n")[0])
    assert re.search(r"\n\| task +\| changed % \|", md)  # columns, padded
    pytest.importorskip("matplotlib", reason="figures need the plots extra")
    names = ["report.json", "report.md", *figures.FIGURES]
    assert f"Report written to {out}: {', '.join(names)}\n" in output
    assert all((out / name).stat().st_size > 0 for name in names)
    assert all(f"![{name[:-4]}]({name})" in md for name in figures.FIGURES)
    assert "pip install" not in output + md


@pytest.mark.parametrize("bad", ["-0.1", "abc", ",", "nan", "inf", ""])
def test_bad_r_values_refused(analyzed, bad):
    assert "--r" in invoke("analyze", analyzed[0], "--r", bad, expect=2)


def test_epsilon_override_is_monotone(models, dense):
    config = write_config(*models, "ramplus")
    changed = []
    for epsilon in (1e-5, 1e-3, 1e-2, 3e-2):
        out = models[0] / f"eps-{epsilon}"
        output = analyze(config, out, "--epsilon", epsilon)
        assert f"epsilon = {epsilon:g}" in output
        report = read_json(out / "report.json")
        assert report["epsilon"] == epsilon
        C, S, U, hist = reference.csu(dense[2](epsilon), len(NAMES))
        assert [t["changed"] for t in report["tasks"]] == C
        assert [t["overlap_histogram"] for t in report["tasks"]] == hist
        changed.append(C)
    for before, after in zip(changed, changed[1:]):
        assert all(a <= b for a, b in zip(after, before))
    assert changed[-1] != changed[0] and sum(changed[-1]) < sum(changed[0])


def spy(monkeypatch, module, name: str, calls: list) -> None:
    """Note each call of module.name (its readers of the models) in `calls`."""
    original = getattr(module, name)
    monkeypatch.setattr(
        module, name, lambda *a, **k: [calls.append(name)] and original(*a, **k)
    )


# id: (method, parameters, the first model's, the dense RAM+ whose retention
# the report gives, or None where another test checks it)
SOFT = {"statistics": "tensor", "saturation": "soft"}
REPORTED = {"ram": ("ram", {}, None, dict(r=PAPER_R))}  # r = 0: the paper's r
REPORTED |= {"ramplus": ("ramplus", {}, None, None)}
TENSOR = dict(r=0.1, **SOFT, unique_scale=[1.5, None, None, None])
REPORTED |= {"tensor": ("ramplus", SOFT, {"unique_scale": 1.5}, TENSOR)}
REPORTED |= {"explicit": ("ramplus", {"unique_scale": 1.25}, None, None)}
# Not ours: DELLA's parameters, the paper's RAM+ defaults.
REPORTED |= {
    "della": ("della", dict(epsilon=0.05, density=0.5, weight=1.0), None, None)
}


@pytest.mark.parametrize("case", list(REPORTED))
def test_merge_report_equals_analyze(
    models, dense, analyzed, tmp_path, monkeypatch, case
):
    """merge --report's report is analyze's, built from the one pass the
    merge's planner counted, RAM and explicit λ included: the models are read
    once. Another method's merge counts nothing: they are read once more, and
    the command says so."""
    method, parameters, first, plus = REPORTED[case]
    config = write_config(*models, method, first, **parameters)
    calls = []
    spy(monkeypatch, statistics, "collect_planned", calls)
    spy(monkeypatch, analysis, "plan_merges", calls)
    merge = ("merge", config, tmp_path / "merged", "--report", tmp_path / "rep")
    output = flat(invoke(*merge, "--quiet"))
    ours = method != "della"
    assert calls == ["plan_merges"] * (not ours) + ["collect_planned"]
    again = f"merge_method {method} is not RAM: reading the models once more"
    assert (again in output) is not ours and "## Per task" in output
    assert (tmp_path / "merged" / "model.safetensors").exists()
    report = read_json(tmp_path / "rep" / REPORT_JSON)
    analyze(config, tmp_path / "ana")
    assert comparable(report) == comparable(read_json(tmp_path / "ana" / REPORT_JSON))
    assert sorted(os.listdir(tmp_path / "rep")) == sorted(os.listdir(tmp_path / "ana"))
    statistics_file = tmp_path / "merged" / "ram_statistics.json"
    assert statistics_file.exists() == (case == "ramplus")
    if case == "ramplus":
        tasks = read_json(statistics_file)["tasks"]
        assert tasks == [{k: t[k] for k in tasks[0]} for t in report["tasks"]]
    if plus:
        assert_retention(report, dense, ["ramplus"], **plus)
        assert report["retention"]["ramplus"]["r"] == plus["r"]
    explicit = [t["scale_explicit"] for t in report["tasks"]]
    if case == "ram":
        assert report["r"] == 0 and all(t["scale"] == 1 for t in report["tasks"])
        # RAM: the report adds the paper's RAM+ r so the user sees its λ.
        assert [s["r"] for s in report["sweep"]] == [PAPER_R]
    elif case == "tensor":  # the explicit λ is reported as such
        assert explicit == [True, False, False, False]
        assert report["tasks"][0]["scale"] == 1.5
        assert report["tasks"][0]["scale_tensor_local"]["min"] == 1.5
    elif case == "explicit":
        assert all(explicit) and {t["scale"] for t in report["tasks"]} == {1.25}
    elif case == "della":  # the paper's RAM+ defaults, and no survival tally
        assert "paper's RAM+ defaults" in output and report["method"] == "della"
        assert (report["epsilon"], report["r"], report["alpha"]) == (1e-5, 0.1, 2.0)
        assert report["tasks"] == analyzed[3]["tasks"]
        assert report["pairwise"] == analyzed[3]["pairwise"]


def test_without_matplotlib_text_and_json_still_written(
    analyzed, tmp_path, monkeypatch
):
    plotting = [n for n in sys.modules if n.startswith("matplotlib.")]
    for name in ["matplotlib", *plotting]:
        monkeypatch.setitem(sys.modules, name, None)
    output = analyze(analyzed[0], tmp_path, drawn=True)
    assert "## Per task" in output
    assert sorted(os.listdir(tmp_path)) == ["report.json", "report.md"]
    assert read_json(tmp_path / "report.json")["tasks"] == analyzed[3]["tasks"]
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    hint = "pip install 'mergekit-ram[plots]'"
    assert hint in output and hint in md


def test_analyze_does_not_modify_the_config(models):
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    config = yaml.safe_load(merge_yaml(models[1], "ramplus"))
    config = MergeConfiguration.model_validate(config)
    before = config.model_dump()
    result = analysis.analyze_config(config, MergeOptions(quiet=True), epsilon=1e-4)
    assert config.model_dump() == before
    assert result.settings.epsilon == 1e-4 and result.stats.epsilon == 1e-4


# A tensor's name, its module and its layer (- for none).
NAMED = ["model.embed_tokens.weight embeddings -"]
NAMED += ["lm_head.weight lm_head -", "transformer.h.2.attn.c_attn.weight attention 2"]
NAMED += ["model.norm.weight norms -", "model.layers.0.self_attn.q_norm.weight norms 0"]
NAMED += ["model.layers.3.input_layernorm.weight norms 3"]
NAMED += ["model.layers.12.post_attention_layernorm.weight norms 12"]
NAMED += ["model.layers.1.self_attn.k_proj.weight attention 1", "score.weight other -"]
NAMED += ["model.layers.1.self_attn.o_proj.bias attention 1"]
NAMED += ["model.layers.7.mlp.down_proj.weight mlp 7"]
NAMED += ["transformer.wte.weight embeddings -"]
NAMED += ["model.layers.2.mlp.experts.5.up_proj.weight mlp 2"]


@pytest.mark.parametrize("name, module, layer", [x.split() for x in NAMED])
def test_module_and_layer_of_names(name, module, layer):
    assert module_of(name) == module
    assert layer_of(name) == (None if layer == "-" else int(layer))


# --- the verdict on agents built to each case ---------------------------------

# Like the paper's agents: independent supports, one sparse agent whose
# changes mostly land on elements a dense agent changes too.
DENSE = (("coder", 0.03), ("tools", 0.45), ("memory", 0.55))
CASES = {"independent": [TaskSpec(name, density=d) for name, d in DENSE]}
# Two agents changing 60 % of a third's elements, plus a few of their own.
SUBSET = dict(subset_of="alpha", share=0.6, plus=0.08)
CASES["overlapping"] = [TaskSpec("alpha", density=0.3)]
CASES["overlapping"] += [TaskSpec(name, **SUBSET) for name in ("beta", "gamma")]
# One agent's changes are a subset of the other's.
CASES["nested"] = [TaskSpec("wide", density=0.3), TaskSpec("inner", subset_of="wide")]


@pytest.mark.parametrize("name", list(CASES))
def test_verdict_and_notes_say_which_case_and_which_agent(name, model_family, tmp_path):
    """The verdict on real models: which case their supports are and which
    agent RAM dilutes (its sentence's wording is test_analysis_verdict's), and
    the notes on unique share and lift only for the cases the numbers show."""
    family = model_family(f"verdict-{name}", CASES[name])
    (tmp_path / "config.yml").write_text(family.yaml("ramplus"), encoding="utf-8")
    output = analyze(tmp_path / "config.yml", tmp_path)
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    report = read_json(tmp_path / REPORT_JSON)
    verdict, text = report["verdict"], flat(output)
    assert all(f"**Verdict:** {verdict['sentence']}" in t for t in (text, markdown))
    assert verdict["supports"] == name
    kept = {t["model"]: t["retention"]["ram"] for t in report["tasks"]}
    lift = [v for row in report["pairwise"]["lift"] for v in row]
    piled = "changes pile up on elements other tasks change too"
    if name == "independent":
        assert all(1 / OVERLAPPING < v < OVERLAPPING for v in lift)
        assert verdict["diluted"] == [family.paths["coder"]]
        assert piled not in text and f"lift ≥ {OVERLAPPING:g}" not in text
        assert "lift ≈ 1: independent supports" in text
        # The same agents merged with `shared: ties` are told it is in use.
        ties = tmp_path / "ties.yml"
        ties.write_text(family.yaml("ramplus", parameters={"shared": "ties"}))
        analyze(ties, tmp_path / "ties")
        sentence = read_json(tmp_path / "ties" / REPORT_JSON)["verdict"]["sentence"]
        assert "RAM would dilute coder" in sentence
        assert "try `shared: ties`" not in sentence
        assert "already uses `shared: ties`" in sentence
    elif name == "overlapping":
        assert min(v for v in lift if v != 1.0) >= OVERLAPPING
        # All three keep about half, within a few percent of each other.
        assert set(verdict["diluted"]) == set(kept)
        assert verdict["diluted"][0] == min(kept, key=kept.__getitem__)
        assert "try tuned task arithmetic / TIES / DARE" in verdict["sentence"]
        labels = ", ".join(t["label"] for t in report["tasks"])
        assert f"Far below expected for {labels}: their {piled}" in text
        assert f"lift ≥ {OVERLAPPING:g}: overlapping supports" in text
        assert "lift ≈ 1" not in text
    else:
        (pair,) = verdict["pairs"]
        assert pair["inside"] >= NESTED
        assert verdict["diluted"] == [family.paths["inner"]]
        assert "nested: at least 90 % of one agent's changes" in text


def test_unique_share_notes_name_only_the_tasks_far_from_expected():
    shares = {"a": (0.19, 0.188), "b": (0.1, 0.5), "c": (0.9, 0.5), "d": (None, None)}
    keys = ("label", "unique_share", "expected_unique_share")
    tasks = [dict(zip(keys, (k, *v))) for k, v in shares.items()]
    assert unique_share_notes(tasks) == [
        "Far below expected for b: their changes pile up on elements other tasks "
        "change too.",
        "Far above expected for c: their changes avoid the elements other tasks "
        "change.",
    ]


def test_a_report_never_replaces_a_file_it_did_not_write(models, tmp_path):
    """A user's own report.md in the --out / --report folder is refused before
    the analysis or the merge; an earlier report of ours is replaced."""
    config = write_config(*models, "ramplus", r=0.1)
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "report.md").write_text("my notes")
    merge = ("merge", config, tmp_path / "merged", "--report", folder)
    for args in (("analyze", config, "--out", folder), merge):
        output = invoke(*args, "--quiet", expect=2)
        assert "holds report.md, which no mergekit-ram report wrote" in flat(output)
        assert (folder / "report.md").read_text() == "my notes"
    assert not (tmp_path / "merged").exists()
    (folder / "report.md").unlink()
    analyze(config, folder)
    analyze(config, folder)  # our own: replaced
    assert read_json(folder / REPORT_JSON)["verdict"]["sentence"]
    # Ours, but report.md a link to the user's notes, or report.json a FIFO
    # (reading it to recognise it would block): refused, nothing written.
    notes = tmp_path / "notes.md"
    notes.write_text("my notes")
    (folder / "report.md").unlink()
    (folder / "report.md").symlink_to(notes)
    analyze(config, folder, expect=2)
    assert notes.read_text() == "my notes"
    (folder / "report.md").unlink()
    (folder / REPORT_JSON).unlink()
    os.mkfifo(folder / REPORT_JSON)
    analyze(config, folder, expect=2)
