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
from unittest import mock

import torch
import yaml
from click.testing import CliRunner
from conftest import THREE_TASKS, Family, build_family
from mergekit.io.lazy_tensor_loader import LazyTensorLoader, ShardedTensorIndex
from mergekit.io.tasks import LoaderCache
from safetensors.torch import load_file, save_file

from mergekit_ram.commands.cli import main
from mergekit_ram.integration import statistics as prefetch

REPO = Path(__file__).resolve().parent.parent
ERRORS_PAGE = REPO / "docs" / "errors.md"
BEGIN = "<!-- rejected-inputs:begin -->"
END = "<!-- rejected-inputs:end -->"
REGENERATE = "python tests/rejected_inputs.py --write"


@dataclass(frozen=True)
class Workspace:
    """What a case may point at: the model family and a scratch directory."""

    family: Family
    root: Path

    def config(self, **changes) -> dict:
        """The family's three-task ramplus config with top-level keys changed."""
        config = self.family.config_dict("ramplus")
        config.update(changes)
        return {key: value for key, value in config.items() if value is not None}

    def models(self, *entries: str | dict) -> list[dict]:
        """A models: list; a str is a family member, a dict is used as is."""
        return [
            {"model": self.family.paths[e]} if isinstance(e, str) else e
            for e in entries
        ]

    def task(self, name: str, **parameters) -> dict:
        """A models: entry for a family member with its own parameters."""
        return {"model": self.family.paths[name], "parameters": parameters}

    def altered(
        self, name: str, copy: str, change: Callable[[dict[str, torch.Tensor]], None]
    ) -> str:
        """A copy of family model `name` as ./copy, its tensors edited by `change`."""
        path = self.root / copy
        shutil.copytree(self.family.paths[name], path, dirs_exist_ok=True)
        weights = str(path / "model.safetensors")
        state = load_file(weights)
        change(state)
        save_file(state, weights, metadata={"format": "pt"})
        return str(path)

    def directory(self, name: str, *files: str) -> str:
        """A scratch directory holding empty files with these names."""
        path = self.root / name
        path.mkdir(exist_ok=True)
        for file in files:
            (path / file).touch()
        return str(path)

    def hub_cache(self, repo: str) -> str:
        """`repo`, with one snapshot of it in a Hugging Face cache under ./hf."""
        folder = self.root / "hf" / f"models--{repo.replace('/', '--')}"
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / "main").write_text("0" * 40)
        snapshot = folder / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text("{}")
        return repo


@dataclass(frozen=True)
class Case:
    """One refused input.

    config: the YAML document (a dict) or its text, built in the workspace.
    expect: fragments the message must contain (the key or model, the fix).
    stage: "config" cases must be refused before mergekit plans (no
    checkpoint opened), "plan" ones on mergekit's plan (no tensor read);
    "merge" cases are found while merging.
    kind: "error" (exit 2) or "warning" (one log line per key; the merge runs).
    """

    id: str
    input: str
    config: Callable[[Workspace], dict | str]
    expect: tuple[str, ...]
    command: str = "merge"
    args: tuple[str, ...] = ()
    stage: str = "config"
    out: str | None = None  # merge's OUT argument (default: out-<id>)
    kind: str = "error"


@dataclass(frozen=True)
class Outcome:
    """What the command printed (placeholdered) and its exit code."""

    exit_code: int
    output: str
    message: str


def _filter(value_mlp, value_rest) -> list[dict]:
    return [{"filter": "mlp", "value": value_mlp}, {"value": value_rest}]


def _nan(state: dict[str, torch.Tensor]) -> None:
    state["model.layers.0.mlp.up_proj.weight"].view(-1)[0] = float("nan")


def _without_lm_head(state: dict[str, torch.Tensor]) -> None:
    del state["lm_head.weight"]


def _linked(ws: Workspace, name: str) -> str:
    """./NAME-link, a symlink to family model `name`."""
    link = ws.root / f"{name}-link"
    if not link.is_symlink():
        link.symlink_to(ws.family.paths[name])
    return f"./{link.name}"


def _loop(ws: Workspace) -> str:
    """./loop, a symlink to itself."""
    link = ws.root / "loop"
    if not link.is_symlink():
        link.symlink_to(link)
    return "./loop"


def _with_file(ws: Workspace, name: str, config: dict) -> dict:
    """config, with a file ./name in the scratch directory."""
    (ws.root / name).write_text("a file")
    return config


def _truncated(ws: Workspace, name: str, copy: str) -> str:
    """A copy of family model `name` as ./copy with its weights cut short."""
    path = ws.altered(name, copy, lambda state: None)
    weights = Path(path) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    return path


def _weights_replaced(
    ws: Workspace, name: str, copy: str, make: Callable[[Path], None]
) -> str:
    """A copy of family model `name` as ./copy whose model.safetensors is
    removed and then made anew by `make(path)`."""
    path = ws.root / copy
    if not path.exists():
        shutil.copytree(ws.family.paths[name], path)
        (path / "model.safetensors").unlink()
        make(path / "model.safetensors")
    return str(path)


def _overlapping(path: Path) -> None:
    """A safetensors file whose two tensors share bytes."""
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(12))


def _float8(state: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = state[name].to(torch.float8_e4m3fn)


def _bad_config_json(ws: Workspace) -> str:
    path = ws.root / "bad-config"
    if not path.exists():
        shutil.copytree(ws.family.paths["beta"], path)
        (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    return str(path)


def _slices(ws: Workspace, layer_range: list[int]) -> list[dict]:
    return [
        {
            "sources": [
                {"model": ws.family.paths[name], "layer_range": layer_range}
                for name in ("base", "alpha", "beta")
            ]
        }
    ]


def _extra_token(state: dict[str, torch.Tensor]) -> None:
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.cat([state[name], state[name][:1]])


CASES: tuple[Case, ...] = (
    # ---- the YAML file itself (mergekit-ram merge and analyze)
    Case(
        "yaml-syntax",
        "YAML with a broken indentation",
        lambda ws: "merge_method: ramplus\nmodels:\n  - model: a\n   - model: b\n",
        ("line 4", "Fix the syntax"),
    ),
    Case(
        "schema-missing-key",
        "a model entry without `model:` (typo `modle:`)",
        lambda ws: ws.config(models=[{"modle": ws.family.paths["alpha"]}]),
        ("models[0].model is required",),
    ),
    Case(
        "schema-many-problems",
        "40 model entries without `model:`",
        lambda ws: ws.config(models=[{"modle": f"m{i}"} for i in range(40)]),
        ("models[4].model is required", "and 35 more problem(s)"),
    ),
    Case(
        "schema-bad-value",
        "`r: null`",
        lambda ws: ws.config(parameters={"r": None}),
        ("parameters.r: null is not a valid value",),
    ),
    Case(
        "schema-models-and-slices",
        "both `models:` and `slices:`",
        lambda ws: {
            **ws.config(),
            "slices": [{"sources": [{"model": "x", "layer_range": [0, 2]}]}],
        },
        ("Exactly one of 'models', 'slices', or 'modules'",),
    ),
    # ---- keys mergekit would silently drop, methods it does not know
    Case(
        "key-typo-top-level",
        "`paramters: {r: 0.5}` (a typo at the top level)",
        lambda ws: {**ws.config(), "paramters": {"r": 0.5}},
        ("paramters:", "would ignore it", "Did you mean 'parameters'?"),
    ),
    Case(
        "parameter-at-top-level",
        "`r: 0.5` at the top level, not under `parameters:`",
        lambda ws: {**ws.config(), "r": 0.5},
        ("r: mergekit does not read 'r' here", "write it under parameters"),
    ),
    Case(
        "parameter-on-a-model-entry",
        "`unique_scale: 3` directly on a model entry",
        lambda ws: ws.config(
            models=[{"model": ws.family.paths["alpha"], "unique_scale": 3}]
            + ws.models("beta")
        ),
        ("models[0].unique_scale", "write it under models[0].parameters"),
    ),
    Case(
        "parameter-singular-under-a-model",
        "`parameter:` (singular) under a model",
        lambda ws: ws.config(
            models=[{"model": ws.family.paths["alpha"], "parameter": {"r": 1}}]
            + ws.models("beta")
        ),
        ("models[0].parameter", "Did you mean 'parameters'?"),
    ),
    Case(
        "two-mistakes-in-one-file",
        "two mistakes and a key RAM ignores in one file (`alpah`, a negative "
        "`r`, `dtyp`)",
        lambda ws: {
            **ws.config(parameters={"r": -1, "alpah": 1.0}),
            "dtyp": "bfloat16",
        },
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
        lambda ws: ws.config(merge_method="rammplus", parameters={"r": -1}),
        ("has 2 problems", "Did you mean 'ramplus'?", "parameters.r: Input should"),
    ),
    Case(
        "key-no-method-reads",
        "`dtyp: bfloat16` (a key mergekit does not read, no RAM key)",
        lambda ws: {**ws.config(), "dtyp": "bfloat16"},
        ("dtyp: mergekit does not read 'dtyp' here", "did you mean 'dtype'?"),
        kind="warning",
    ),
    Case(
        "yaml-duplicate-key",
        "a key written twice (`parameters:` twice at the top level)",
        lambda ws: (
            yaml.safe_dump(ws.config(parameters={"r": 0.5}), sort_keys=False)
            + "parameters: {alpha: 1.0}\n"
        ),
        ("the key 'parameters' is written twice", "Write it once"),
    ),
    Case(
        "yaml-control-character",
        "a control character in the file",
        lambda ws: "merge_method: ramplus\x08\n",
        ("control character '\\x08'", "Remove it"),
    ),
    Case(
        "yaml-method-not-text",
        "`merge_method: [ramplus]` (a list)",
        lambda ws: ws.config(merge_method=["ramplus"]),
        ("merge_method", "valid string"),
    ),
    *(
        Case(
            f"method-{slug}",
            f"`merge_method: {method}`",
            lambda ws, method=method: ws.config(merge_method=method),
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
        lambda ws: {
            **ws.config(models=None),
            "slices": [
                {
                    "sources": [
                        {"model": ws.family.paths[name], "layer_range": [0, 2]}
                        for name in ("base", *ws.family.tasks)
                    ],
                    "base_model": ws.family.paths["alpha"],
                }
            ],
        },
        ("slices[0]: its base model", "remove that slice's base_model"),
    ),
    Case(
        "no-base",
        "no `base_model:`",
        lambda ws: ws.config(base_model=None),
        ("needs a base_model", "Add 'base_model: path/to/base'"),
    ),
    Case(
        "base-only",
        "only the base model under `models:`",
        lambda ws: ws.config(models=ws.models("base")),
        ("at least one task model", "list the fine-tuned models"),
    ),
    Case(
        "duplicate-model",
        "the same task model listed twice",
        lambda ws: ws.config(models=ws.models("alpha", "beta", "alpha")),
        ("models[2]", "already listed as models[0]", "List each model once"),
    ),
    Case(
        "slice-without-base",
        "a slice whose sources lack the base model",
        lambda ws: ws.config(
            models=None,
            slices=[
                {
                    "sources": [
                        {"model": ws.family.paths[name], "layer_range": [0, 2]}
                        for name in ("alpha", "beta")
                    ]
                }
            ],
        ),
        ("slices[0]", "add it as a source"),
    ),
    # ---- model paths
    Case(
        "missing-path",
        "a base model path that does not exist",
        lambda ws: ws.config(base_model=str(ws.family.root / "missing")),
        ("base_model", "MODELS/missing does not exist", "Fix the path"),
    ),
    Case(
        "missing-relative-path",
        "a relative task model path that does not exist",
        lambda ws: ws.config(models=ws.models("alpha", {"model": "./beta"})),
        ("models[1].model", "./beta does not exist", "current directory, CWD"),
    ),
    Case(
        "path-is-a-file",
        "a file where a model directory belongs",
        lambda ws: ws.config(base_model=str(ws.family.root / "base" / "config.json")),
        ("base_model", "is a file", "model's directory"),
    ),
    Case(
        "no-weights",
        "a model directory without weights",
        lambda ws: ws.config(
            models=ws.models("alpha", {"model": ws.directory("empty", "config.json")})
        ),
        ("models[1].model", "has no weights", "model.safetensors"),
    ),
    Case(
        "lora-as-model",
        "a LoRA adapter directory given as a model",
        lambda ws: ws.config(
            models=ws.models(
                "alpha",
                {"model": ws.directory("adapter", "adapter_config.json")},
            )
        ),
        ("has no weights", "LoRA adapter", "BASE+"),
    ),
    Case(
        "no-config-json",
        "a model directory without config.json",
        lambda ws: ws.config(
            models=ws.models(
                "alpha", {"model": ws.directory("weights-only", "model.safetensors")}
            )
        ),
        ("models[1].model", "has no config.json", "save_pretrained"),
    ),
    Case(
        "missing-tokenizer-source",
        "a `tokenizer_source:` path that does not exist",
        lambda ws: ws.config(tokenizer_source="./tokenizer"),
        ("tokenizer_source", "does not exist"),
    ),
    Case(
        "same-model-two-spellings",
        "one model twice: its path, and `./alpha-link`, a symlink to it",
        lambda ws: ws.config(
            models=ws.models("alpha", "beta", {"model": _linked(ws, "alpha")})
        ),
        ("models[2]", "same folder as", "List each model once"),
    ),
    Case(
        "truncated-safetensors",
        "a task model whose model.safetensors is cut short",
        lambda ws: ws.config(
            models=ws.models("alpha", {"model": _truncated(ws, "beta", "cut-beta")})
        ),
        ("CWD/cut-beta", "not a valid safetensors file", "not fully covered"),
    ),
    Case(
        "overlapping-tensors",
        "a model.safetensors whose tensors overlap",
        lambda ws: ws.config(
            models=ws.models(
                "alpha",
                {"model": _weights_replaced(ws, "beta", "overlap", _overlapping)},
            )
        ),
        ("CWD/overlap", "not a valid safetensors file", "invalid offset"),
    ),
    Case(
        "weights-folder",
        "a folder named model.safetensors",
        lambda ws: ws.config(
            models=ws.models(
                "alpha",
                {"model": _weights_replaced(ws, "beta", "folder", Path.mkdir)},
            )
        ),
        ("CWD/folder", "model.safetensors is a folder, where a regular file belongs"),
    ),
    Case(
        "dangling-weights-link",
        "a model.safetensors symlink to a file that is gone",
        lambda ws: ws.config(
            models=ws.models(
                "alpha",
                {
                    "model": _weights_replaced(
                        ws,
                        "beta",
                        "dangling",
                        lambda p: p.symlink_to(p.parent / "gone"),
                    )
                },
            )
        ),
        ("CWD/dangling", "model.safetensors is a symlink to", "does not exist"),
    ),
    Case(
        "model-in-a-symlink-loop",
        "a model path that is a symlink to itself",
        lambda ws: ws.config(models=ws.models("alpha", {"model": _loop(ws)})),
        ("./loop is (or lies under) a symlink loop", "Fix the path"),
    ),
    Case(
        "empty-output-path",
        'an empty output path (`"$OUTDIR"` unset)',
        lambda ws: ws.config(),
        ("output folder path is empty", "Name the folder"),
        out="",
    ),
    Case(
        "output-under-a-file",
        "an output path under a file",
        lambda ws: _with_file(ws, "notes.txt", ws.config()),
        ("notes.txt/merged", "which is a file", "Choose a folder"),
        out="notes.txt/merged",
    ),
    Case(
        "report-under-a-file",
        "`--report` under a file",
        lambda ws: _with_file(ws, "notes.txt", ws.config()),
        ("report folder notes.txt/report", "which is a file"),
        args=("--report", "notes.txt/report"),
    ),
    Case(
        "float8-weights",
        "a task model with one float8 (F8_E4M3) tensor",
        lambda ws: ws.config(
            models=ws.models("alpha", {"model": ws.altered("beta", "fp8", _float8)})
        ),
        ("model.layers.0.mlp.up_proj.weight", "CWD/fp8", "F8_E4M3", "bfloat16"),
    ),
    Case(
        "invalid-config-json",
        "a task model whose config.json is not valid JSON",
        lambda ws: ws.config(
            models=ws.models("alpha", {"model": _bad_config_json(ws)})
        ),
        ("models[1].model", "config.json is not valid JSON"),
    ),
    Case(
        "slice-out-of-range",
        "a slice `layer_range: [0, 5]` of 2-layer models",
        lambda ws: ws.config(models=None, slices=_slices(ws, [0, 5])),
        ("slices[0].sources[0].layer_range", "has 2 layers", "0 ≤ start < end ≤ 2"),
    ),
    Case(
        "missing-lm-head",
        "a task model without the base's untied `lm_head.weight`",
        lambda ws: ws.config(
            models=ws.models(
                "alpha", {"model": ws.altered("beta", "headless", _without_lm_head)}
            )
        ),
        ("lm_head.weight", "CWD/headless", "embed_tokens"),
    ),
    # ---- parameter names
    Case(
        "rescale-factor",
        "`rescale_factor: 1.2` (the authors' flag)",
        lambda ws: ws.config(parameters={"rescale_factor": 1.2}),
        ("parameters.rescale_factor", "r: R − 1", "alpha: 1", "saturation: soft"),
    ),
    Case(
        "misspelled-parameter",
        "`alpah: 1.0`",
        lambda ws: ws.config(parameters={"alpah": 1.0}),
        ("parameters.alpah", "Did you mean 'alpha'?"),
    ),
    Case(
        "other-method-parameter",
        "`weight: 0.5` on a task model (a linear or TIES template)",
        lambda ws: ws.config(models=[ws.task("alpha", weight=0.5)]),
        ("models[0].parameters.weight", "does not use 'weight'", "ignored"),
        kind="warning",
    ),
    Case(
        "other-method-parameter-top-level",
        "`normalize: true`, `int8_mask: true`, `lambda: 1` (a TIES template)",
        lambda ws: ws.config(
            parameters={"normalize": True, "int8_mask": True, "lambda": 1.0}
        ),
        ("parameters.normalize", "parameters.int8_mask", "parameters.lambda"),
        kind="warning",
    ),
    Case(
        "no-method-has-the-parameter",
        "`frobnicate: 2` under `parameters:` (no method's, no RAM near miss)",
        lambda ws: ws.config(parameters={"frobnicate": 2}),
        ("parameters.frobnicate", "no mergekit method has a parameter"),
        kind="warning",
    ),
    Case(
        "other-method-per-model-parameter",
        "`epsilon:` under one task model (DELLA's per-model epsilon)",
        lambda ws: ws.config(models=[ws.task("alpha", epsilon=1e-4)]),
        ("models[0].parameters.epsilon", "della"),
        kind="warning",
    ),
    Case(
        "global-parameter-on-model",
        "`alpha:` under one task model",
        lambda ws: ws.config(models=[ws.task("alpha", alpha=1.0)]),
        ("models[0].parameters.alpha", "top-level parameters"),
    ),
    Case(
        "unique-scale-on-base",
        "`unique_scale:` on the base model listed under `models:`",
        lambda ws: ws.config(
            models=[ws.task("base", unique_scale=1.2), *ws.models("alpha")]
        ),
        ("models[0].parameters.unique_scale", "base model", "Remove it"),
    ),
    # ---- parameter values
    Case(
        "negative-r",
        "`r: -0.1`",
        lambda ws: ws.config(parameters={"r": -0.1}),
        ("parameters.r", "greater than or equal to 0", "(got -0.1)"),
    ),
    Case(
        "nan-epsilon",
        "`epsilon: .nan`",
        lambda ws: ws.config(parameters={"epsilon": float("nan")}),
        ("parameters.epsilon", "Input should be a finite number", "(got nan)"),
    ),
    Case(
        "infinite-alpha",
        "`alpha: .inf`",
        lambda ws: ws.config(parameters={"alpha": float("inf")}),
        ("parameters.alpha", "Input should be a finite number", "(got inf)"),
    ),
    Case(
        "empty-list",
        "`r: []`",
        lambda ws: ws.config(parameters={"r": []}),
        ("parameters.r", "empty list", "default"),
    ),
    Case(
        "lambda-overflow",
        "`r: 1e308` (λ beyond what the output can hold)",
        lambda ws: ws.config(parameters={"r": 1e308}),
        ("r = 1e+308", "±Inf", "out_dtype"),
        stage="plan",
    ),
    Case(
        "text-unique-scale",
        "`unique_scale: high` on a task model",
        lambda ws: ws.config(models=[ws.task("alpha", unique_scale="high")]),
        ("models[0].parameters.unique_scale", "Input should be a valid number"),
    ),
    Case(
        "boolean-r",
        "`r: true`",
        lambda ws: ws.config(parameters={"r": True}),
        ("parameters.r", "is not a number"),
    ),
    Case(
        "negative-in-filter",
        "a negative `alpha` inside a filter",
        lambda ws: ws.config(parameters={"alpha": _filter(-1.0, 2.0)}),
        ("parameters.alpha", "greater than or equal to 0", "(got -1.0)"),
    ),
    Case(
        "unknown-saturation",
        "`saturation: hard`",
        lambda ws: ws.config(parameters={"saturation": "hard"}),
        ("parameters.saturation", "Input should be 'clip' or 'soft'"),
    ),
    Case(
        "unknown-statistics",
        "`statistics: model`",
        lambda ws: ws.config(parameters={"statistics": "model"}),
        ("parameters.statistics", "Input should be 'global' or 'tensor'"),
    ),
    Case(
        "unknown-shared",
        "`shared: median`",
        lambda ws: ws.config(parameters={"shared": "median"}),
        ("parameters.shared", "Input should be 'mean', 'ties' or 'base'"),
    ),
    Case(
        "density-above-one",
        "`density: 1.5` with `shared: ties`",
        lambda ws: ws.config(parameters={"shared": "ties", "density": 1.5}),
        ("parameters.density", "Input should be less than or equal to 1"),
    ),
    Case(
        "density-without-ties",
        "`density` without `shared: ties`",
        lambda ws: ws.config(parameters={"density": 0.2}),
        ("parameters.density", "only applies with shared: ties", "is ignored"),
        stage="plan",
        kind="warning",
    ),
    Case(
        "alpha-with-the-soft-rule",
        "`alpha` with `saturation: soft` (the soft rule has no alpha)",
        lambda ws: ws.config(parameters={"saturation": "soft", "alpha": 5.0}),
        ("parameters.alpha", "only applies with saturation: clip", "remove alpha"),
        stage="plan",
    ),
    Case(
        "density-and-alpha-both-ignored",
        "`density` without ties, `alpha` with the soft rule and a model's "
        "`weight`, in one file",
        lambda ws: ws.config(
            parameters={"saturation": "soft", "alpha": 5.0, "density": 0.2},
            models=[ws.task("alpha", weight=1.0)],
        ),
        (
            "has 1 problem (and warnings)",
            "alpha only applies",
            "warning: parameters.density: density only",
            "warning: models[0].parameters.weight",
        ),
        stage="plan",
    ),
    Case(
        "shared-under-model",
        "`shared` under one model",
        lambda ws: ws.config(
            models=[ws.task("alpha", shared="ties"), *ws.models("beta", "gamma")]
        ),
        ("models[0].parameters.shared", "top-level parameters"),
    ),
    # ---- one value where whole-model statistics need one
    Case(
        "epsilon-filter-global",
        "a per-tensor filter on `epsilon` with global statistics",
        lambda ws: ws.config(parameters={"epsilon": _filter(1e-4, 1e-5)}),
        ("'epsilon'", "remove the per-tensor filter", "statistics: tensor"),
        stage="plan",
    ),
    Case(
        "r-gradient-global",
        "a gradient `r: [0.1, 0.3]` with global statistics",
        lambda ws: ws.config(parameters={"r": [0.1, 0.3]}),
        ("'r'", "is 0.1 for tensor", "statistics: tensor"),
        stage="plan",
    ),
    Case(
        "unique-scale-gradient",
        "a gradient `unique_scale: [1.0, 1.2]` on a task model",
        lambda ws: ws.config(models=[ws.task("alpha", unique_scale=[1.0, 1.2])]),
        ("unique_scale for model MODELS/alpha", "remove its filter or gradient"),
        stage="plan",
    ),
    # ---- dtypes and devices
    Case(
        "dtype-misspelled",
        "`dtype: bf16`",
        lambda ws: ws.config(dtype="bf16"),
        ("dtype: 'bf16'", "not a dtype mergekit knows", "bfloat16, float16"),
    ),
    Case(
        "out-dtype-not-float",
        "`out_dtype: bool`",
        lambda ws: ws.config(out_dtype="bool"),
        ("out_dtype: 'bool'", "bfloat16, float16, float32, float64"),
    ),
    # ---- the tensors, found while merging
    Case(
        "nan-in-tensor",
        "a task model with a NaN in one tensor",
        lambda ws: ws.config(
            models=ws.models("alpha", {"model": ws.altered("beta", "nan-beta", _nan)})
        ),
        ("model.layers.0.mlp.up_proj.weight", "CWD/nan-beta", "nonfinite: ignore"),
        stage="merge",
    ),
    Case(
        "vocabulary-mismatch",
        "a task model with one more token and no `tokenizer_source:`",
        lambda ws: ws.config(
            models=ws.models(
                "alpha", {"model": ws.altered("beta", "wide-beta", _extra_token)}
            )
        ),
        ("(49, 32) in model CWD/wide-beta", "tokenizer_source: union"),
        stage="merge",
    ),
    # ---- mergekit-ram analyze (any merge method)
    Case(
        "analyze-no-base",
        "`mergekit-ram analyze` of a TIES config without a base model",
        lambda ws: ws.config(
            merge_method="ties",
            base_model=None,
            models=[ws.task(t.name, weight=1.0, density=0.5) for t in THREE_TASKS],
        ),
        ("mergekit-ram analyze needs a base_model",),
        command="analyze",
    ),
)


@contextmanager
def no_weight_reads(stage: str = "config") -> Iterator[None]:
    """Fail loudly if mergekit opens a checkpoint (stage "config") or reads
    a tensor (stage "plan": mergekit's plan opens the indexes) while the
    block runs."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a checkpoint was opened before validation refused")

    spies = [(LazyTensorLoader, "get_tensor"), (prefetch, "safetensors_spans")]
    if stage == "config":
        spies += [(LoaderCache, "get"), (ShardedTensorIndex, "from_disk")]
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


def run_case(case: Case, ws: Workspace) -> Outcome:
    """Run the case's command from ws.root; the printed error, placeholdered."""
    config = case.config(ws)
    text = config if isinstance(config, str) else yaml.safe_dump(config)
    name = f"{case.id}.yml"
    (ws.root / name).write_text(text, encoding="utf-8")
    args = [case.command, name]
    if case.command == "merge":
        args.append(f"out-{case.id}" if case.out is None else case.out)
    args += ["--quiet", *case.args]
    previous = os.getcwd()
    os.chdir(ws.root)
    try:
        with warnings_logged() as warned:
            if case.stage in ("config", "plan") and case.kind == "error":
                with no_weight_reads(case.stage):
                    result = CliRunner().invoke(main, args)
            else:
                result = CliRunner().invoke(main, args)
    finally:
        os.chdir(previous)
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
    """The markdown table of every case's input and the message it printed."""
    rows = ["| Input | Kind | Message |", "|---|---|---|"]
    for case in CASES:
        message = outcomes[case.id].message
        rows.append(f"| {_cell(case.input)} | {case.kind} | {_cell(message)} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    """Table-safe: a | would split the cell, a < would start an HTML tag, a
    block's lines are shown as lines."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", "<br>")


def errors_block(page: str) -> str:
    """The text between the errors page's rejected-inputs markers."""
    start = page.index(BEGIN) + len(BEGIN)
    return page[start : page.index(END)].strip("\n")


def with_block(page: str, table: str) -> str:
    """The errors page with `table` between the rejected-inputs markers."""
    start = page.index(BEGIN) + len(BEGIN)
    return f"{page[:start]}\n{table}\n{page[page.index(END) :]}"


def make_workspace(root: Path) -> Workspace:
    family = build_family(root / "models", THREE_TASKS)
    scratch = root / "work"
    scratch.mkdir()
    return Workspace(family, scratch)


def main_write(write: bool) -> None:
    """Print the freshly rendered table, or write it into docs/errors.md."""
    with tempfile.TemporaryDirectory() as tmp:
        ws = make_workspace(Path(tmp))
        table = render_table({case.id: run_case(case, ws) for case in CASES})
    if not write:
        print(table)
        return
    page = ERRORS_PAGE.read_text(encoding="utf-8")
    ERRORS_PAGE.write_text(with_block(page, table), encoding="utf-8")
    print(f"docs/errors.md: {len(CASES)} rejected inputs")


if __name__ == "__main__":
    main_write("--write" in sys.argv[1:])
