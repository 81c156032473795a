"""Every input mergekit-ram refuses or warns about, and the docs/errors.md table
of their messages.

One list of cases feeds both tests/test_integration_validation.py (an error
must exit 2 with a message that names the key or model and the fix, and no
traceback; a warning must merge, exit 0, and name the key it ignores) and the
table in docs/errors.md ("Errors you may see"), which shows the messages
`mergekit-ram` actually printed, so the two cannot drift. After changing a
message, regenerate the table with

    python tests/rejected_inputs.py --write

A case runs the CLI from a scratch directory on the tiny float32 family of
conftest.py (base + alpha, beta, gamma); paths in messages are shown as
MODELS (the family's directory), CWD (the scratch directory) and REPO
(this checkout).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from string import Template
from unittest import mock

import torch
import yaml
from click.testing import CliRunner
from conftest import THREE_TASKS, Family, build_family
from mergekit.io.lazy_tensor_loader import LazyTensorLoader
from mergekit.io.tasks import LoaderCache
from safetensors.torch import load_file, save_file

from mergekit_ram.commands.cli import main
from mergekit_ram.integration import statistics as prefetch

REPO = Path(__file__).resolve().parent.parent
ERRORS_PAGE = REPO / "docs" / "errors.md"
BEGIN = "<!-- rejected-inputs:begin -->"
END = "<!-- rejected-inputs:end -->"
REGENERATE = "python tests/rejected_inputs.py --write"
UP = "model.layers.0.mlp.up_proj.weight"


@dataclass(frozen=True)
class Workspace:
    """What a case may point at: the model family and a scratch directory."""

    family: Family
    root: Path

    def names(self) -> dict[str, str]:
        """$base, $alpha, … and $models (the family's folder) for a case's YAML."""
        return {**self.family.paths, "models": str(self.family.root)}

    def config(self, **changes) -> dict:
        """The family's three-task ramplus config with top-level keys changed
        (None: removed)."""
        config = {**self.family.config_dict("ramplus"), **changes}
        return {key: value for key, value in config.items() if value is not None}

    def pair(self, path: str) -> dict:
        """The config merging alpha and the model at `path`."""
        return self.config(
            models=[{"model": self.family.paths["alpha"]}, {"model": path}]
        )

    def copy(self, name: str, copy: str) -> Path:
        """Family model `name` copied to ./copy (once)."""
        path = self.root / copy
        if not path.exists():
            shutil.copytree(self.family.paths[name], path)
        return path

    def altered(self, copy: str, change: Callable[[dict], None]) -> str:
        """A copy of beta as ./copy, its tensors edited by `change`."""
        weights = self.copy("beta", copy) / "model.safetensors"
        state = load_file(weights)
        change(state)
        save_file(state, weights, metadata={"format": "pt"})
        return str(weights.parent)

    def directory(self, name: str, *files: str) -> str:
        """A scratch directory holding empty files with these names."""
        (self.root / name).mkdir(exist_ok=True)
        for file in files:
            (self.root / name / file).touch()
        return str(self.root / name)


@dataclass(frozen=True)
class Case:
    """One refused input.

    config: top-level keys as YAML (with $base, $alpha, … $models), or a
    function of the workspace giving the document (a dict) or its text.
    expect: fragments the message must contain (the key or model, the fix).
    stage: "config" cases must be refused before mergekit plans (no
    checkpoint opened), "plan" ones on mergekit's plan (no tensor read);
    "merge" cases are found while merging.
    kind: "error" (exit 2) or "warning" (one log line per key; the merge runs).
    out: merge's OUT argument, as YAML names (default: out-<id>).
    """

    id: str
    input: str
    config: str | Callable[[Workspace], dict | str]
    expect: tuple[str, ...]
    command: str = "merge"
    args: tuple[str, ...] = ()
    stage: str = "config"
    out: str | None = None
    kind: str = "error"


@dataclass(frozen=True)
class Outcome:
    """What the command printed (placeholdered) and its exit code."""

    exit_code: int
    output: str
    message: str


def _slices(names: tuple[str, ...], layers: list[int], base: str = "") -> str:
    sources = ", ".join(f"{{model: ${n}, layer_range: {layers}}}" for n in names)
    return f"models: null\nslices: [{{sources: [{sources}]{base}}}]"


def _with_file(ws: Workspace, name: str) -> dict:
    (ws.root / name).write_text("a file")
    return ws.config()


def _bytes_edited(ws: Workspace, copy: str, edit: Callable[[bytes], bytes]) -> dict:
    """alpha and a copy of beta whose model.safetensors bytes are edited."""
    weights = ws.copy("beta", copy) / "model.safetensors"
    weights.write_bytes(edit(weights.read_bytes()))
    return ws.pair(str(weights.parent))


def _overlapping(_: bytes) -> bytes:
    """A safetensors file whose two tensors share bytes."""
    a, b = ({"dtype": "F32", "shape": [2], "data_offsets": [i, i + 8]} for i in (0, 4))
    header = json.dumps({"a": a, "b": b}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(12)


def _sharded(ws: Workspace) -> dict:
    """beta in two shards, the second missing."""
    path = ws.copy("beta", "sharded")
    if (path / "model.safetensors").exists():
        names = sorted(state := load_file(path / "model.safetensors"))
        save_file({k: state[k] for k in names[:10]}, path / "model-1.safetensors")
        shard = {k: f"model-{1 + (i >= 10)}.safetensors" for i, k in enumerate(names)}
        index = json.dumps({"metadata": {}, "weight_map": shard})
        (path / "model.safetensors.index.json").write_text(index)
        (path / "model.safetensors").unlink()
    return ws.pair(str(path))


def _nan(state: dict[str, torch.Tensor]) -> None:
    state[UP].view(-1)[0] = float("nan")


def _float8(state: dict[str, torch.Tensor]) -> None:
    state[UP] = state[UP].to(torch.float8_e4m3fn)


def _narrow(state: dict[str, torch.Tensor]) -> None:
    state[UP] = state[UP][:, :16].contiguous()


def _extra_token(state: dict[str, torch.Tensor]) -> None:
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.cat([state[name], state[name][:1]])


def _filter(mlp: str, rest: str) -> str:
    return f"[{{filter: mlp, value: {mlp}}}, {{value: {rest}}}]"


def _value(id: str, value: str, *expect: str) -> Case:
    """The case of one `key: value` under parameters, its message naming it."""
    key, config = value.split(":")[0], f"parameters: {{{value}}}"
    return Case(id, f"`{value}`", config, (f"parameters.{key}", *expect))


CASES: tuple[Case, ...] = (
    # ---- the YAML file itself (mergekit-ram merge and analyze)
    Case(
        "yaml-syntax",
        "YAML with a broken indentation",
        lambda ws: "merge_method: ramplus\nmodels:\n  - model: a\n   - model: b\n",
        ("not valid YAML at line 4", "expected <block end>"),
    ),
    Case(
        "schema-missing-key",
        "a model entry without `model:` (typo `modle:`)",
        "models: [{modle: $alpha}]",
        ("models[0].model: Field required",),
    ),
    Case(
        "schema-many-problems",
        "40 model entries without `model:`",
        lambda ws: ws.config(models=[{"modle": f"m{i}"} for i in range(40)]),
        ("models[4].model: Field required", "and 35 more"),
    ),
    _value(
        "schema-bad-value",
        "r: null",
        "parameters.r.float: Input should be a valid number",
    ),
    Case(
        "schema-models-and-slices",
        "both `models:` and `slices:`",
        "slices: [{sources: [{model: x, layer_range: [0, 2]}]}]",
        ("Exactly one of 'models', 'slices', or 'modules'",),
    ),
    # ---- keys mergekit would silently drop, methods it does not know
    Case(
        "key-typo-top-level",
        "`paramters: {r: 0.5}` (a typo at the top level)",
        "paramters: {r: 0.5}",
        ("paramters:", "would ignore it", "Did you mean 'parameters'?"),
    ),
    Case(
        "parameter-at-top-level",
        "`r: 0.5` at the top level, not under `parameters:`",
        "r: 0.5",
        ("r: mergekit does not read 'r' here", "write it under parameters"),
    ),
    Case(
        "parameter-on-a-model-entry",
        "`unique_scale: 3` directly on a model entry",
        "models: [{model: $alpha, unique_scale: 3}, {model: $beta}]",
        ("models[0].unique_scale", "write it under models[0].parameters"),
    ),
    Case(
        "parameter-singular-under-a-model",
        "`parameter:` (singular) under a model",
        "models: [{model: $alpha, parameter: {r: 1}}, {model: $beta}]",
        ("models[0].parameter", "Did you mean 'parameters'?"),
    ),
    Case(
        "two-mistakes-in-one-file",
        "two mistakes and a key RAM ignores in one file (`alpah`, a negative "
        "`r`, `dtyp`)",
        "parameters: {r: -1, alpah: 1.0}\ndtyp: bfloat16",
        (
            "has 2 problems (and warnings)",
            "Did you mean 'alpha'?",
            "parameters.r: Input should be greater than or equal to 0",
            "- warning: dtyp:",
        ),
    ),
    Case(
        "two-mistakes-and-a-misspelled-method",
        "`merge_method: rammplus` and a negative `r` in one file",
        "merge_method: rammplus\nparameters: {r: -1}",
        ("has 2 problems", "Did you mean 'ramplus'?", "parameters.r: Input should"),
    ),
    Case(
        "key-no-method-reads",
        "`dtyp: bfloat16` (a key mergekit does not read, no RAM key)",
        "dtyp: bfloat16",
        ("dtyp: mergekit does not read 'dtyp' here", "did you mean 'dtype'?"),
        kind="warning",
    ),
    Case(
        "yaml-duplicate-key",
        "a key written twice (`parameters:` twice at the top level)",
        lambda ws: (
            yaml.safe_dump(ws.config(parameters={"r": 0.5}))
            + "parameters: {alpha: 1.0}\n"
        ),
        ("the key 'parameters' is written twice", "Write it once"),
    ),
    Case(
        "yaml-control-character",
        "a control character in the file",
        lambda ws: "merge_method: ramplus\x08\n",
        ("not valid YAML", "unacceptable character #x0008"),
    ),
    Case(
        "yaml-method-not-text",
        "`merge_method: [ramplus]` (a list)",
        "merge_method: [ramplus]",
        ("merge_method", "valid string"),
    ),
    *(
        Case(
            f"method-{slug}",
            f"`merge_method: {method}`",
            f"merge_method: {method}",
            (f"'{method}' is not a merge method", f"Did you mean '{meant}'?"),
        )
        for slug, method, meant in (
            ("rammplus", "rammplus", "ramplus"),
            ("upper-case", "RAM", "ram"),
            ("ram-plus-sign", "ram+", "ramplus"),
            ("ram-underscore-plus", "ram_plus", "ramplus"),
        )
    ),
    # ---- which models are merged
    Case(
        "slice-base-differs",
        "a slice's own `base_model:`, another model than the configuration's",
        _slices(("base", "alpha", "beta", "gamma"), [0, 2], ", base_model: $alpha"),
        ("slices[0]: its base model", "remove that slice's base_model"),
    ),
    Case(
        "no-base",
        "no `base_model:`",
        "base_model: null",
        ("needs a base_model", "Add 'base_model: path/to/base'"),
    ),
    Case(
        "base-only",
        "only the base model under `models:`",
        "models: [{model: $base}]",
        ("at least one task model", "list the fine-tuned models"),
    ),
    Case(
        "duplicate-model",
        "the same task model listed twice",
        "models: [{model: $alpha}, {model: $beta}, {model: $alpha}]",
        ("models[2]", "already listed as models[0]", "List each model once"),
    ),
    Case(
        "slice-without-base",
        "a slice whose sources lack the base model",
        _slices(("alpha", "beta"), [0, 2]),
        ("slices[0]", "add it as a source"),
    ),
    # ---- model paths
    Case(
        "missing-path",
        "a base model path that does not exist",
        "base_model: $models/missing",
        ("base_model", "MODELS/missing does not exist", "Fix the path"),
    ),
    Case(
        "missing-relative-path",
        "a relative task model path that does not exist",
        "models: [{model: $alpha}, {model: ./beta}]",
        ("models[1].model", "./beta does not exist", "current directory, CWD"),
    ),
    Case(
        "path-is-a-file",
        "a file where a model directory belongs",
        "base_model: $base/config.json",
        ("base_model", "is a file", "model's directory"),
    ),
    Case(
        "no-weights",
        "a model directory without weights",
        lambda ws: ws.pair(ws.directory("empty", "config.json")),
        ("models[1].model", "has no weights", "model.safetensors"),
    ),
    Case(
        "lora-as-model",
        "a LoRA adapter directory given as a model",
        lambda ws: ws.pair(ws.directory("adapter", "adapter_config.json")),
        ("has no weights", "LoRA adapter", "BASE+"),
    ),
    Case(
        "no-config-json",
        "a model directory without config.json",
        lambda ws: ws.pair(ws.directory("weights-only", "model.safetensors")),
        ("models[1].model", "has no config.json", "save_pretrained"),
    ),
    Case(
        "missing-tokenizer-source",
        "a `tokenizer_source:` path that does not exist",
        "tokenizer_source: ./tokenizer",
        ("tokenizer_source", "does not exist"),
    ),
    # ---- checkpoints, from their headers
    Case(
        "truncated-safetensors",
        "a task model whose model.safetensors is cut short",
        lambda ws: _bytes_edited(ws, "cut", lambda data: data[:-64]),
        ("CWD/cut", "not a valid safetensors file", "not fully covered"),
    ),
    Case(
        "corrupt-header",
        "a model.safetensors whose header is not UTF-8",
        lambda ws: _bytes_edited(ws, "corrupt", lambda d: d[:8] + b"\xff\xfe" + d[10:]),
        ("CWD/corrupt", "not a valid safetensors file", "invalid UTF-8"),
    ),
    Case(
        "huge-header",
        "a model.safetensors whose header length is 1 TiB",
        lambda ws: _bytes_edited(
            ws, "huge", lambda d: (2**40).to_bytes(8, "little") + d[8:]
        ),
        ("CWD/huge", "header too large"),
    ),
    Case(
        "overlapping-tensors",
        "a model.safetensors whose tensors overlap",
        lambda ws: _bytes_edited(ws, "overlap", _overlapping),
        ("CWD/overlap", "not a valid safetensors file", "invalid offset"),
    ),
    Case(
        "missing-shard",
        "a sharded task model whose second shard is missing",
        _sharded,
        ("CWD/sharded", "names the shard model-2.safetensors, which is missing"),
    ),
    Case(
        "float8-weights",
        "a task model with one float8 (F8_E4M3) tensor",
        lambda ws: ws.pair(ws.altered("fp8", _float8)),
        (UP, "CWD/fp8", "F8_E4M3", "only with the scales", "dequantize it"),
    ),
    Case(
        "missing-lm-head",
        "a task model without the base's untied `lm_head.weight`",
        lambda ws: ws.pair(ws.altered("headless", lambda s: s.pop("lm_head.weight"))),
        ("lm_head.weight", "CWD/headless", "embed_tokens"),
    ),
    Case(
        "shape-mismatch",
        "a task model with a narrower up_proj",
        lambda ws: ws.pair(ws.altered("narrow", _narrow)),
        (UP, "(64, 16) in model CWD/narrow"),
    ),
    # ---- folders the merge writes
    Case(
        "empty-output-path",
        'an empty output path (`"$OUTDIR"` unset)',
        "{}",
        ("output folder path is empty", "Name the folder"),
        out="",
    ),
    Case(
        "output-under-a-file",
        "an output path under a file",
        lambda ws: _with_file(ws, "notes.txt"),
        ("notes.txt/merged", "which is a file", "Choose a folder"),
        out="notes.txt/merged",
    ),
    Case(
        "report-under-a-file",
        "`--report` under a file",
        lambda ws: _with_file(ws, "notes.txt"),
        ("report folder notes.txt/report", "which is a file"),
        args=("--report", "notes.txt/report"),
    ),
    Case(
        "output-is-an-input",
        "OUT the `tokenizer_source:` folder",
        lambda ws: ws.config(tokenizer_source=str(ws.copy("alpha", "tok"))),
        ("output folder tok is the input tokenizer_source", "Choose another"),
        out="tok",
    ),
    Case(
        "output-inside-an-input",
        "OUT inside a task model's folder",
        "{}",
        ("MODELS/beta/merged lies inside the input model MODELS/beta",),
        out="$beta/merged",
    ),
    # ---- parameter names
    Case(
        "rescale-factor",
        "`rescale_factor: 1.2` (the authors' flag)",
        "parameters: {rescale_factor: 1.2}",
        ("parameters.rescale_factor", "r: R − 1", "alpha: 1", "saturation: soft"),
    ),
    _value("misspelled-parameter", "alpah: 1.0", "Did you mean 'alpha'?"),
    Case(
        "other-method-parameter",
        "`weight: 0.5` on a task model (a linear or TIES template)",
        "models: [{model: $alpha, parameters: {weight: 0.5}}]",
        ("models[0].parameters.weight", "does not use 'weight'", "ignored"),
        kind="warning",
    ),
    Case(
        "other-method-parameter-top-level",
        "`normalize: true`, `int8_mask: true`, `lambda: 1` (a TIES template)",
        "parameters: {normalize: true, int8_mask: true, lambda: 1.0}",
        ("parameters.normalize", "parameters.int8_mask", "parameters.lambda"),
        kind="warning",
    ),
    Case(
        "no-method-has-the-parameter",
        "`frobnicate: 2` under `parameters:` (no method's, no RAM near miss)",
        "parameters: {frobnicate: 2}",
        ("parameters.frobnicate", "no mergekit method has a parameter"),
        kind="warning",
    ),
    Case(
        "other-method-per-model-parameter",
        "`epsilon:` under one task model (DELLA's per-model epsilon)",
        "models: [{model: $alpha, parameters: {epsilon: 1.0e-4}}]",
        ("models[0].parameters.epsilon", "della"),
        kind="warning",
    ),
    Case(
        "global-parameter-on-model",
        "`alpha:` under one task model",
        "models: [{model: $alpha, parameters: {alpha: 1.0}}]",
        ("models[0].parameters.alpha", "top-level parameters"),
    ),
    Case(
        "unique-scale-on-base",
        "`unique_scale:` on the base model listed under `models:`",
        "models: [{model: $base, parameters: {unique_scale: 1.2}}, {model: $alpha}]",
        ("models[0].parameters.unique_scale", "base model", "Remove it"),
    ),
    Case(
        "shared-under-model",
        "`shared` under one model",
        "models: [{model: $alpha, parameters: {shared: ties}}, {model: $beta}]",
        ("models[0].parameters.shared", "top-level parameters"),
    ),
    # ---- parameter values
    _value("negative-r", "r: -0.1", "greater than or equal to 0", "(got -0.1)"),
    _value(
        "nan-epsilon", "epsilon: .nan", "Input should be a finite number", "(got nan)"
    ),
    _value(
        "infinite-alpha", "alpha: .inf", "Input should be a finite number", "(got inf)"
    ),
    Case(
        "lambda-overflow",
        "`r: 1e308` (λ beyond what the output can hold)",
        "parameters: {r: 1.0e+308}",
        ("infinite or NaN values", "λ·τ overflowed", "out_dtype: float32"),
        stage="merge",
    ),
    Case(
        "text-unique-scale",
        "`unique_scale: high` on a task model",
        "models: [{model: $alpha, parameters: {unique_scale: high}}]",
        ("models[0].parameters.unique_scale", "Input should be a valid number"),
    ),
    _value("boolean-r", "r: true", "is not a number"),
    Case(
        "negative-in-filter",
        "a negative `alpha` inside a filter",
        f"parameters: {{alpha: {_filter('-1.0', '2.0')}}}",
        ("parameters.alpha", "greater than or equal to 0", "(got -1.0)"),
    ),
    _value(
        "unknown-saturation", "saturation: hard", "Input should be 'clip' or 'soft'"
    ),
    _value(
        "unknown-statistics",
        "statistics: model",
        "Input should be 'global' or 'tensor'",
    ),
    _value(
        "unknown-shared", "shared: median", "Input should be 'mean', 'ties' or 'base'"
    ),
    Case(
        "density-above-one",
        "`density: 1.5` with `shared: ties`",
        "parameters: {shared: ties, density: 1.5}",
        ("parameters.density", "Input should be less than or equal to 1"),
    ),
    Case(
        "density-without-ties",
        "`density` without `shared: ties`",
        "parameters: {density: 0.2}",
        ("parameters.density", "only applies with shared: ties", "is ignored"),
        stage="plan",
        kind="warning",
    ),
    Case(
        "rule-keys-with-r-zero",
        "`ram` (r = 0) with `alpha` and `statistics`, which only RAM+ uses",
        "merge_method: ram\nparameters: {alpha: 3.0, statistics: tensor}",
        ("parameters.alpha", "with r = 0 every λ is 1", "remove statistics"),
        stage="plan",
        kind="warning",
    ),
    Case(
        "epsilon-per-slice-global",
        "an `epsilon` in one slice's parameters with global statistics",
        _slices(
            ("base", "alpha", "beta"), [0, 1], ", parameters: {epsilon: 0.001}"
        ).removesuffix("]")
        + ", {sources: [{model: $base, layer_range: [1, 2]}, "
        "{model: $alpha, layer_range: [1, 2]}, {model: $beta, layer_range: [1, 2]}]}]",
        ("(set at slices[0].parameters.epsilon)", "none per slice"),
        stage="plan",
    ),
    Case(
        "alpha-with-the-soft-rule",
        "`alpha` with `saturation: soft` (the soft rule has no alpha)",
        "parameters: {saturation: soft, alpha: 5.0}",
        ("parameters.alpha", "only applies with saturation: clip", "remove alpha"),
        stage="plan",
    ),
    Case(
        "density-and-alpha-both-ignored",
        "`density` without ties, `alpha` with the soft rule and a model's "
        "`weight`, in one file",
        "parameters: {saturation: soft, alpha: 5.0, density: 0.2}\n"
        "models: [{model: $alpha, parameters: {weight: 1.0}}]",
        (
            "has 1 problem (and warnings)",
            "alpha only applies",
            "warning: parameters.density: density only",
            "warning: models[0].parameters.weight",
        ),
        stage="plan",
    ),
    # ---- one value where whole-model statistics need one
    Case(
        "epsilon-filter-global",
        "a per-tensor filter on `epsilon` with global statistics",
        f"parameters: {{epsilon: {_filter('1.0e-4', '1.0e-5')}}}",
        ("'epsilon'", "(set at parameters.epsilon)", "statistics: tensor"),
        stage="plan",
    ),
    Case(
        "r-gradient-global",
        "a gradient `r: [0.1, 0.3]` with global statistics",
        "parameters: {r: [0.1, 0.3]}",
        ("'r'", "is 0.1 for tensor", "statistics: tensor"),
        stage="plan",
    ),
    Case(
        "unique-scale-gradient",
        "a gradient `unique_scale: [1.0, 1.2]` on a task model",
        "models: [{model: $alpha, parameters: {unique_scale: [1.0, 1.2]}}]",
        ("unique_scale for model MODELS/alpha", "remove its filter or gradient"),
        stage="plan",
    ),
    # ---- dtypes
    Case(
        "dtype-misspelled",
        "`dtype: bf16`",
        "dtype: bf16",
        ("dtype: 'bf16'", "not a dtype mergekit knows", "bfloat16, float16"),
    ),
    Case(
        "out-dtype-not-float",
        "`out_dtype: bool`",
        "out_dtype: bool",
        ("out_dtype: 'bool'", "bfloat16, float16, float32, float64"),
    ),
    # ---- the tensors, found while merging
    Case(
        "nan-in-tensor",
        "a task model with a NaN in one tensor",
        lambda ws: ws.pair(ws.altered("nan-beta", _nan)),
        (UP, "CWD/nan-beta", "nonfinite: ignore"),
        stage="merge",
    ),
    Case(
        "vocabulary-mismatch",
        "a task model with one more token and no `tokenizer_source:`",
        lambda ws: ws.pair(ws.altered("wide-beta", _extra_token)),
        ("(49, 32) in model CWD/wide-beta", "tokenizer_source: union"),
        stage="merge",
    ),
    # ---- mergekit-ram analyze (any merge method)
    Case(
        "analyze-no-base",
        "`mergekit-ram analyze` of a TIES config without a base model",
        "merge_method: ties\nbase_model: null\n"
        "models: [{model: $alpha, parameters: {weight: 1.0, density: 0.5}}]",
        ("mergekit-ram analyze needs a base_model",),
        command="analyze",
    ),
)


@contextmanager
def no_weight_reads(stage: str = "config") -> Iterator[None]:
    """Fail loudly if mergekit opens a checkpoint (stage "config") or reads
    a tensor (stage "plan": mergekit's plan opens the indexes) while the
    block runs."""

    refuse = mock.Mock(side_effect=AssertionError("a checkpoint was opened"))
    spies = [(LazyTensorLoader, "get_tensor"), (prefetch, "safetensors_spans")]
    if stage == "config":
        spies.append((LoaderCache, "get"))
    with ExitStack() as stack:
        for owner, name in spies:
            stack.enter_context(mock.patch.object(owner, name, refuse))
        yield


@contextmanager
def warnings_logged() -> Iterator[list[str]]:
    """The warning lines mergekit-ram logs while the block runs."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("mergekit_ram")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def document(case: Case, ws: Workspace) -> str:
    """The case's configuration file's text."""
    if callable(case.config):
        config = case.config(ws)
        return config if isinstance(config, str) else yaml.safe_dump(config)
    changes = yaml.safe_load(Template(case.config).substitute(ws.names()))
    return yaml.safe_dump(ws.config(**changes))


def run_case(case: Case, ws: Workspace) -> Outcome:
    """Run the case's command from ws.root; the printed error, placeholdered."""
    name = f"{case.id}.yml"
    (ws.root / name).write_text(document(case, ws), encoding="utf-8")
    args = [case.command, name]
    if case.command == "merge":
        out = f"out-{case.id}" if case.out is None else case.out
        args.append(Template(out).substitute(ws.names()))
    args += ["--quiet", *case.args]
    previous = os.getcwd()
    os.chdir(ws.root)
    with warnings_logged() as warned, ExitStack() as guard:
        guard.callback(os.chdir, previous)
        if case.stage in ("config", "plan") and case.kind == "error":
            guard.enter_context(no_weight_reads(case.stage))
        result = CliRunner().invoke(main, args)
    output = placeholders(result.output, ws)
    if case.kind == "warning":
        return Outcome(result.exit_code, output, placeholders("\n".join(warned), ws))
    # One paragraph, or a block listing several problems, to the end.
    found = re.search(r"^Error: (.*)", output, flags=re.MULTILINE | re.DOTALL)
    return Outcome(result.exit_code, output, found.group(1).strip() if found else "")


def placeholders(text: str, ws: Workspace) -> str:
    """Scratch paths as MODELS and CWD, this checkout as REPO, so the table
    does not change per run or machine."""
    paths = ((ws.family.root, "MODELS"), (ws.root.resolve(), "CWD"), (REPO, "REPO"))
    for path, name in paths:
        text = text.replace(str(path), name)
    return text


def render_table(outcomes: dict[str, Outcome]) -> str:
    """The markdown table of every case's input and the message it printed
    (a | would split a cell, a < start an HTML tag)."""
    rows = ["| Input | Kind | Message |", "|---|---|---|"]
    escape = str.maketrans({"|": "\\|", "<": "&lt;", "\n": "<br>"})
    for case in CASES:
        cells = (case.input, case.kind, outcomes[case.id].message)
        rows.append(f"| {' | '.join(c.translate(escape) for c in cells)} |")
    return "\n".join(rows)


def errors_block(page: str) -> str:
    """The text between the errors page's rejected-inputs markers."""
    return page[page.index(BEGIN) + len(BEGIN) : page.index(END)].strip("\n")


def main_write(write: bool) -> None:
    """Print the freshly rendered table, or write it into docs/errors.md."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "work").mkdir()
        family = build_family(Path(tmp) / "models", THREE_TASKS)
        ws = Workspace(family, Path(tmp) / "work")
        table = render_table({case.id: run_case(case, ws) for case in CASES})
    if not write:
        return print(table)
    page = ERRORS_PAGE.read_text(encoding="utf-8")
    ERRORS_PAGE.write_text(page.replace(errors_block(page), table), encoding="utf-8")
    print(f"docs/errors.md: {len(CASES)} rejected inputs")


if __name__ == "__main__":
    main_write("--write" in sys.argv[1:])
