"""Checks of a merge configuration, before any weight is read.

mergekit 0.1.5 ignores parameter names it does not know, checks values only
while planning (after every checkpoint's index was opened, with a pydantic
traceback) and lets a missing model fail deep inside transformers or the hub
client. These checks read at most a directory listing, so the first problem
a user must fix is reported as one RAMInputError paragraph before the merge
starts. They are pure and cheap: every entry point may call them.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import huggingface_hub
import torch
from huggingface_hub import constants
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id
from mergekit.common import ModelPath, ModelReference, dtype_from_name
from mergekit.config import (
    ConditionalParameter,
    InputModelDefinition,
    MergeConfiguration,
    OutputSliceDefinition,
)
from mergekit.merge_methods.base import ParameterScope, ParameterSpec
from mergekit.options import MergeOptions

from mergekit_ram.errors import RAMInputError
from mergekit_ram.headers import check_models
from mergekit_ram.method import METHODS, PARAMETER_HELP, RAMMerge, is_ours
from mergekit_ram.paths import first_duplicate, identity
from mergekit_ram.scale import ScaleRule
from mergekit_ram.settings import SCALAR_KEYS, one_value_error, unique_scale_error

# What mergekit's ShardedTensorIndex.from_disk looks for in a model directory.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

RESCALE_FACTOR_HINT = (
    "The authors' --rescale_factor R is r = R − 1 here: their arm-r-v2 is "
    "r: R − 1 with alpha: 1, their arm-r is r: R − 1 with saturation: soft "
    "(R = 1.2 is r: 0.2)."
)


@dataclass(frozen=True)
class Block:
    """One `parameters:` mapping of the configuration and whom it applies to."""

    label: str
    settings: Mapping[str, Any]
    model: ModelReference | None = None
    base: ModelReference | None = None

    def where(self, name: str) -> str:
        """The key as the YAML spells it, with the model it belongs to."""
        model = "" if self.model is None else f" (model {self.model})"
        return f"{self.label}.{name}{model}"


@dataclass(frozen=True)
class Source:
    """One input model of a group, with its own parameters."""

    label: str
    model: ModelReference
    block: Block


@dataclass(frozen=True)
class Group:
    """Models merged together (a `models:` list or one slice) and their base.

    `blocks` are the group-wide parameter mappings, highest precedence first;
    `adds_base` says whether mergekit adds a base missing from the inputs
    (it does for `models:` lists, not for slices).
    """

    label: str
    base: ModelReference | None
    sources: tuple[Source, ...]
    blocks: tuple[Block, ...]
    adds_base: bool


def validate_config(
    config: MergeConfiguration, options: MergeOptions | None = None
) -> None:
    """Refuse a `ram` / `ramplus` merge the user must fix; other methods pass.

    Raises RAMInputError naming the key or model and the fix.
    """
    if is_ours(config.merge_method):
        _validate(config, options, f"merge_method {config.merge_method}")


def validate_analysis(
    config: MergeConfiguration, options: MergeOptions | None = None
) -> None:
    """Refuse what `mergekit-ram analyze` cannot measure, for any merge method.

    The models must exist and form base + task models; the parameters are
    only checked for our methods, whose r / alpha / saturation analyze uses.
    """
    _validate(config, options, "mergekit-ram analyze")


def _validate(
    config: MergeConfiguration, options: MergeOptions | None, user: str
) -> None:
    groups = _groups(config)
    for group in groups:
        _check_group(group, user)
    cache_dir = options.transformers_cache if options is not None else None
    for role, reference in _model_references(config, groups):
        _check_reference(reference, role, cache_dir)
    tokenizer = config.tokenizer.source if config.tokenizer else None
    for role, source in (
        ("tokenizer_source", config.tokenizer_source),
        ("tokenizer.source", tokenizer),
    ):
        if isinstance(source, ModelReference):
            _check_location(source.model, role, cache_dir, model=False)
    if is_ours(config.merge_method):
        method = next(m for m in METHODS if m.spec.name == config.merge_method)
        _check_parameters(groups, method)
        _check_output_range(config, groups, method)
    _check_headers(config, groups, options)


# ------------------------------------------------------------ configuration


def _groups(config: MergeConfiguration) -> list[Group]:
    """Every group of inputs mergekit will merge, in configuration order."""
    top = Block("parameters", config.parameters or {})
    groups = []
    if config.models:
        groups.append(_models_group("models", config.models, config.base_model, top))
    for index, output in enumerate(config.slices or ()):
        groups.append(_slice_group(f"slices[{index}]", output, config.base_model, top))
    for name, module in (config.modules or {}).items():
        label = f"modules.{name}"
        outer = (Block(f"{label}.parameters", module.parameters or {}), top)
        if module.models:
            groups.append(
                _models_group(
                    f"{label}.models", module.models, config.base_model, *outer
                )
            )
        for index, output in enumerate(module.slices or ()):
            groups.append(
                _slice_group(
                    f"{label}.slices[{index}]", output, config.base_model, *outer
                )
            )
    return groups


def _models_group(
    label: str,
    models: list[InputModelDefinition],
    base: ModelReference | None,
    *blocks: Block,
) -> Group:
    sources = tuple(
        _source(f"{label}[{index}]", entry.model, entry.parameters, base)
        for index, entry in enumerate(models)
    )
    return Group(label, base, sources, blocks, adds_base=True)


def _slice_group(
    label: str,
    output: OutputSliceDefinition,
    base: ModelReference | None,
    *outer: Block,
) -> Group:
    base = output.base_model or base
    sources = tuple(
        _source(f"{label}.sources[{index}]", entry.model, entry.parameters, base)
        for index, entry in enumerate(output.sources)
    )
    blocks = (Block(f"{label}.parameters", output.parameters or {}), *outer)
    return Group(label, base, sources, blocks, adds_base=False)


def _source(
    label: str,
    model: ModelReference,
    parameters: Mapping[str, Any] | None,
    base: ModelReference | None,
) -> Source:
    block = Block(f"{label}.parameters", parameters or {}, model=model, base=base)
    return Source(label, model, block)


def _check_group(group: Group, user: str) -> None:
    """Base present, each model once, at least one task model."""
    if group.base is None:
        raise RAMInputError(
            f"{user} needs a base_model: the model the task models were "
            "fine-tuned from, which every task vector is measured against. Add "
            "'base_model: path/to/base' to the configuration."
        )
    models = [source.model for source in group.sources]
    if not group.adds_base and group.base not in models:
        raise RAMInputError(
            f"{group.label}: the base model {group.base} is not among its "
            "sources, and mergekit needs it there for a slice: add it as a "
            "source with the same layer_range as the others."
        )
    for index, source in enumerate(group.sources):
        if source.model in models[:index]:
            first = group.sources[models.index(source.model)]
            raise RAMInputError(
                f"{source.label}: model {source.model} is already listed as "
                f"{first.label}. List each model once (the base model may appear "
                "once among the models)."
            )
    duplicate = first_duplicate(
        [("base_model", _spelled(group.base))]
        + [(s.label, _spelled(s.model)) for s in group.sources if s.model != group.base]
    )
    if duplicate is not None:
        (first, path), (label, again) = duplicate
        raise RAMInputError(
            f"{label}: {again} is the same folder as {first} {path} (after "
            "resolving symlinks and '..'), so it would be counted twice. List "
            "each model once, spelled the same way everywhere."
        )
    if all(model == group.base for model in models):
        raise RAMInputError(
            f"{user} needs at least one task model besides the base model "
            f"{group.base} in {group.label}: list the fine-tuned models to merge."
        )


def _spelled(reference: ModelReference) -> str:
    """A reference's path, with its LoRA (a different model when it has one)."""
    lora = "" if reference.lora is None else f"+{identity(reference.lora.path)}"
    return reference.model.path + lora


# ------------------------------------------------------------------ models


def _model_references(
    config: MergeConfiguration, groups: list[Group]
) -> Iterator[tuple[str, ModelReference]]:
    """Each model the merge reads (once), with the key that names it."""
    found: list[tuple[str, ModelReference]] = []
    if config.base_model is not None:
        found.append(("base_model", config.base_model))
    for group in groups:
        found += [(f"{s.label}.model", s.model) for s in group.sources]
    seen: set[ModelReference] = set()
    for role, reference in found:
        if reference not in seen:
            seen.add(reference)
            yield role, reference


def _check_reference(
    reference: ModelReference, role: str, cache_dir: str | None
) -> None:
    _check_location(reference.model, role, cache_dir, model=True)
    if reference.lora is not None:
        _check_location(reference.lora, f"{role} (LoRA)", cache_dir, model=False)


def _check_location(
    location: ModelPath, role: str, cache_dir: str | None, *, model: bool
) -> None:
    """A local model directory, or a hub id mergekit can fetch."""
    path = location.path
    if os.path.isdir(path):
        if model:
            _check_model_directory(path, role)
        return
    if os.path.exists(path):
        raise RAMInputError(
            f"{role}: {path} is a file; mergekit needs the model's directory "
            "(config.json and its weights)."
        )
    if not _is_repo_id(path):
        raise RAMInputError(
            f"{role}: {path} does not exist{_relative_to(path)}. Fix the path, "
            "or create the model there first."
        )
    if not constants.HF_HUB_OFFLINE:
        return  # mergekit downloads it; the network is not ours to try here
    snapshot = _cached_snapshot(location, role, cache_dir)
    if model:
        # mergekit 0.1.5 lists a hub repository's files online before it
        # reads a cached copy of its weights.
        raise RAMInputError(
            f"{role}: {location} is a hub id, found in the local Hugging Face "
            "cache, but mergekit 0.1.5 asks the hub for its file list before "
            "loading weights, which HF_HUB_OFFLINE=1 forbids. Write the cached "
            f"snapshot's directory instead: {snapshot}"
        )


def _check_model_directory(path: str, role: str) -> None:
    names = set(os.listdir(path))
    if not names.intersection(WEIGHT_FILES):
        adapter = (
            f" It holds a LoRA adapter: write the model as BASE+{path}."
            if "adapter_config.json" in names
            else ""
        )
        raise RAMInputError(
            f"{role}: {path} has no weights mergekit can load; it looks for "
            f"{', '.join(WEIGHT_FILES)}. Point {role} at the directory "
            f"save_pretrained wrote the model to.{adapter}"
        )
    if "config.json" not in names:
        raise RAMInputError(
            f"{role}: {path} has no config.json, which mergekit reads the "
            "architecture from. Copy it from the model this one was "
            "fine-tuned from, or save the model with save_pretrained."
        )


def _cached_snapshot(location: ModelPath, role: str, cache_dir: str | None) -> str:
    """The cached snapshot of a hub id; offline, there is no other source."""
    try:
        return huggingface_hub.snapshot_download(
            location.path,
            revision=location.revision,
            cache_dir=cache_dir,
            local_files_only=True,
        )
    except LocalEntryNotFoundError as error:
        raise RAMInputError(
            f"{role}: {location} is not a local directory"
            f"{_relative_to(location.path)}, and not in the local Hugging Face "
            "cache either; with HF_HUB_OFFLINE=1 it cannot be downloaded. Fix "
            "the path, or download the model while online."
        ) from error


def _is_repo_id(path: str) -> bool:
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _relative_to(path: str) -> str:
    if os.path.isabs(path):
        return ""
    return f" (relative paths start from the current directory, {os.getcwd()})"


def _check_headers(
    config: MergeConfiguration, groups: list[Group], options: MergeOptions | None
) -> None:
    """Every local input's checkpoint headers; for `models:` lists also each
    task model against the base (slices may differ by layer range)."""
    vocabulary_free = bool(
        config.tokenizer_source
        or config.tokenizer
        or (options is not None and options.unsafe_truncate_embeddings)
    )
    for group in groups:
        tasks = [
            (f"{s.label}.model", s.model.model.path)
            for s in group.sources
            if s.model != group.base and _local(s.model)
        ]
        if group.base is not None and _local(group.base):
            check_models(
                ("base_model", group.base.model.path),
                tasks,
                compare=group.adds_base,
                vocabulary_free=vocabulary_free,
            )


def _local(reference: ModelReference) -> bool:
    return reference.lora is None and os.path.isdir(reference.model.path)


# -------------------------------------------------------------- parameters


def _check_parameters(groups: list[Group], method: RAMMerge) -> None:
    specs = {spec.name: spec for spec in method.spec.parameters}
    name = method.spec.name
    for block in _unique_blocks(groups):
        for key, setting in block.settings.items():
            spec = specs.get(key)
            if spec is None:
                raise _unknown(block, key, name, specs)
            _check_scope(block, spec)
            if _empty(setting):
                raise RAMInputError(
                    f"{block.where(key)}: an empty list gives {key} no value, "
                    "and mergekit would silently use the default. Write a value "
                    "or remove the key."
                )
            for value in _leaves(setting):
                _check_value(block, spec, value)
    _check_one_value(groups, specs)


def _unique_blocks(groups: list[Group]) -> Iterator[Block]:
    """Every parameters mapping once: group-wide ones, then per model."""
    seen: set[str] = set()
    for group in groups:
        for block in (*group.blocks, *(source.block for source in group.sources)):
            if block.label not in seen:
                seen.add(block.label)
                yield block


def _unknown(
    block: Block, key: str, method: str, specs: Mapping[str, ParameterSpec]
) -> RAMInputError:
    if key == "rescale_factor":
        hint = RESCALE_FACTOR_HINT
    else:
        close = difflib.get_close_matches(key, list(specs), n=1)
        hint = f"Did you mean '{close[0]}'?" if close else "Remove it."
    return RAMInputError(
        f"{block.where(key)}: {method} has no parameter '{key}', and mergekit "
        f"would silently ignore it. {hint} Its parameters: {', '.join(specs)}."
    )


def _check_scope(block: Block, spec: ParameterSpec) -> None:
    """A model's own mapping may hold only per-model, non-base parameters."""
    if block.model is None:
        return
    if spec.scope == ParameterScope.SHARED:
        raise RAMInputError(
            f"{block.where(spec.name)}: '{spec.name}' applies to the whole "
            "merge, and mergekit ignores it under one model. Move it to the "
            "top-level parameters."
        )
    if block.model == block.base and spec.scope == ParameterScope.NON_BASE:
        raise RAMInputError(
            f"{block.where(spec.name)}: the base model has no task vector to "
            f"scale, and mergekit ignores {spec.name} on it. Remove it, or set "
            "it on a task model."
        )


def _leaves(setting: Any) -> Iterator[Any]:
    """The scalar values a setting holds (inside filters and gradients)."""
    if isinstance(setting, ConditionalParameter):
        yield from _leaves(setting.value)
    elif isinstance(setting, list):
        for item in setting:
            yield from _leaves(item)
    else:
        yield setting


def _empty(setting: Any) -> bool:
    """An empty list anywhere in a setting (a gradient or filter value)."""
    if isinstance(setting, ConditionalParameter):
        return _empty(setting.value)
    if isinstance(setting, list):
        return not setting or any(_empty(item) for item in setting)
    return False


def _check_value(block: Block, spec: ParameterSpec, value: Any) -> None:
    choices = _choices(spec)
    if choices:
        if value not in choices:
            raise RAMInputError(
                f"{block.where(spec.name)}: {value!r} is not allowed; "
                f"{spec.name} ({PARAMETER_HELP[spec.name]}) must be one of "
                f"{', '.join(choices)}."
            )
        return
    problem = number_problem(value)
    if problem:
        raise RAMInputError(
            f"{block.where(spec.name)}: {value!r} {problem}; {spec.name} "
            f"({PARAMETER_HELP[spec.name]}) must be a finite number ≥ 0."
        )


def _choices(spec: ParameterSpec) -> tuple[str, ...]:
    """The allowed strings of a Literal-typed parameter, else ()."""
    if get_origin(spec.value_type) is Literal:
        return get_args(spec.value_type)
    return ()


def number_problem(value: Any) -> str:
    """Why `value` is not a finite number ≥ 0 ('' when it is)."""
    if isinstance(value, bool):
        return "is not a number"
    try:
        number = float(value)
    except ValueError:
        return "is not a number"
    if math.isnan(number):
        return "is NaN"
    if math.isinf(number):
        return "is infinite"
    return "is negative" if number < 0 else ""


def _check_output_range(
    config: MergeConfiguration, groups: list[Group], method: RAMMerge
) -> None:
    """λ must fit the output dtype (and float32, the kernel's): a λ beyond it
    turns every unique element into ±Inf."""
    name = config.out_dtype or config.dtype or "float32"
    dtype = dtype_from_name(name)
    if not dtype.is_floating_point:
        return
    limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    specs = {spec.name: spec for spec in method.spec.parameters}
    values = {
        key: set().union(*(_possible(specs[key], g.blocks) for g in groups))
        for key in ("r", "alpha", "saturation")
    }
    candidates = []
    for r in values["r"]:
        for alpha in values["alpha"]:
            for saturation in values["saturation"]:
                rule = ScaleRule(r=r, alpha=alpha, saturation=saturation)
                candidates.append((rule.limit(), f"r = {r:g} with alpha = {alpha:g}"))
    for group in groups:
        for source in group.sources:
            blocks = (source.block, *group.blocks)
            for scale in _possible(specs["unique_scale"], blocks) - {None}:
                candidates.append((scale, f"unique_scale = {scale:g} ({source.model})"))
    for scale, origin in candidates:
        if scale > limit:
            raise RAMInputError(
                f"{origin} allows λ up to {scale:g}, beyond the largest {name} "
                f"value the output can hold ({limit:g}): every element that "
                "one task model alone changes would be written as ±Inf. Lower "
                "r, alpha or unique_scale, or write a wider dtype (out_dtype)."
            )


def _check_one_value(groups: list[Group], specs: Mapping[str, ParameterSpec]) -> None:
    """What whole-model statistics and explicit λ need as one value.

    A key may vary per tensor through a filter, a gradient or a slice-level
    mapping; for global statistics (statistics: global with r > 0)
    epsilon, r, alpha, saturation and statistics may not, and a task
    model's unique_scale never may.
    """
    values = {
        key: set().union(*(_possible(specs[key], g.blocks) for g in groups))
        for key in SCALAR_KEYS
    }
    if "global" in values["statistics"] and any(r > 0 for r in values["r"]):
        for key in SCALAR_KEYS:
            if len(values[key]) > 1:
                raise one_value_error(
                    key,
                    f"takes the values {_listed(values[key])} here (a filter, "
                    "a gradient or a per-slice value)",
                )
    spec = specs["unique_scale"]
    for group in groups:
        for source in group.sources:
            if source.model == group.base:
                continue
            scales = _possible(spec, (source.block, *group.blocks))
            if len(scales) > 1:
                raise unique_scale_error(
                    source.model, f"takes the values {_listed(scales)} here"
                )


def _possible(spec: ParameterSpec, blocks: Iterable[Block]) -> set[Any]:
    """Every value a tensor can resolve `spec` to, walking blocks as mergekit.

    mergekit takes the first mapping (highest precedence first) whose
    setting matches the tensor, then the default.
    """
    found: set[Any] = set()
    for block in blocks:
        setting = block.settings.get(spec.name)
        if setting is None:
            continue
        found.update(spec.validate(value) for value in _leaves(setting))
        if _covers_every_tensor(setting):
            return found
    found.add(spec.default)
    return found


def _covers_every_tensor(setting: Any) -> bool:
    """Whether no tensor falls through this setting to the next mapping."""
    if isinstance(setting, ConditionalParameter):
        return setting.filter in (None, "*") and _covers_every_tensor(setting.value)
    if isinstance(setting, list):
        return bool(setting) and (
            all(not isinstance(item, ConditionalParameter) for item in setting)
            or any(_covers_every_tensor(item) for item in setting)
        )
    return True


def _listed(values: Iterable[Any]) -> str:
    return ", ".join(sorted("unset" if v is None else str(v) for v in values))
