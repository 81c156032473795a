"""Checks that every model a configuration names can be loaded, before loading it.

A local model directory must hold weights mergekit can load and a valid
config.json, and no named pipe or device file a reader would block on; a
hub id is accepted when the hub answers (mergekit downloads it) and
otherwise (HF_HUB_OFFLINE=1, or no answer within seconds: `hub`) refused,
with the cached snapshot's directory to use instead where there is one. Reads a
directory listing and config.json, then (`check_headers`) each local
checkpoint's headers and index, a few kilobytes per file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from functools import partial

import huggingface_hub
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from mergekit.architecture import arch_info_for_config
from mergekit.common import ModelPath, ModelReference
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import (
    WEIGHT_FILES,
    check_models,
    regular_file,
)
from mergekit_ram.integration.config_groups import Group
from mergekit_ram.integration.hub import hub_reachable, is_repo_id, silent_hub


def model_references(
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


def _unreachable(path: str) -> str | None:
    """Why a local path that is not a folder cannot be one (None: it is
    simply missing): a symlink loop, a dangling symlink, no permission."""
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "is (or lies under) a symlink loop"
        if os.path.islink(path):
            return f"is a symlink to {os.readlink(path)}, which does not exist"
        if error.errno != errno.ENOENT:
            return f"cannot be reached ({error.strerror})"
    return None


def check_reference(
    reference: ModelReference, role: str, cache_dir: str | None
) -> None:
    check_location(reference.model, role, cache_dir, model=True)
    if reference.lora is not None:
        check_location(reference.lora, f"{role} (LoRA)", cache_dir, model=False)


def check_location(
    location: ModelPath, role: str, cache_dir: str | None, *, model: bool
) -> None:
    """A local model directory, or a hub id mergekit can fetch: the hub is
    asked (`hub`) only for a reference that is no local path."""
    path = location.path
    if os.path.isdir(path):
        _check_entries(path, role)
        if model:
            _check_model_directory(path, role)
        return
    if os.path.exists(path):
        raise RAMInputError(
            f"{role}: {path} is a file; mergekit needs the model's directory "
            "(config.json and its weights)."
        )
    unreachable = _unreachable(path)
    if unreachable or not is_repo_id(path):
        raise RAMInputError(
            f"{role}: {path} {unreachable or 'does not exist'}"
            f"{_relative_to(path)}. Fix the path, or create the model there first."
        )
    if hub_reachable():
        return  # mergekit downloads it
    snapshot = _cached_snapshot(location, role, cache_dir)
    if model:
        # mergekit 0.1.5 lists a hub repository's files online before it
        # reads a cached copy of its weights.
        refusal = (
            "which HF_HUB_OFFLINE=1 forbids"
            if constants.HF_HUB_OFFLINE
            else f"and {silent_hub()}"
        )
        raise RAMInputError(
            f"{role}: {location} is a hub id, found in the local Hugging Face "
            "cache, but mergekit 0.1.5 asks the hub for its file list before "
            f"loading weights, {refusal}. Write the cached snapshot's "
            f"directory instead: {snapshot}"
        )


def check_headers(
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
                read=partial(_architecture_names, group.base, options),
            )


def check_layer_ranges(config: MergeConfiguration) -> None:
    """Every top-level slice's layer_range lies within its local model's
    layers (num_hidden_layers of its config.json); mergekit would fail on
    the first missing layer's tensor, after the merge started."""
    for index, output in enumerate(config.slices or ()):
        for number, source in enumerate(output.sources):
            if source.layer_range is None or not _local(source.model):
                continue
            path = source.model.model.path
            where = f"slices[{index}].sources[{number}]"
            layers = model_config(path, f"{where}.model").get("num_hidden_layers")
            start, end = source.layer_range
            if isinstance(layers, int) and not 0 <= start < end <= layers:
                raise RAMInputError(
                    f"{where}.layer_range: "
                    f"[{start}, {end}] is outside model {path}, which has "
                    f"{layers} layers (num_hidden_layers in its config.json). "
                    f"A range [start, end] needs 0 ≤ start < end ≤ {layers}."
                )


def model_config(path: str, role: str) -> dict:
    """A local model's config.json as a mapping; mergekit reads it first."""
    file = os.path.join(path, "config.json")
    regular_file(file, role, path)
    try:
        with open(file, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        problem = " ".join(str(error).split())[:300]
        raise RAMInputError(
            f"{role} {path}: config.json is not valid JSON ({problem}). Fix it, "
            "or copy the config.json of the model this one was fine-tuned from."
        ) from None
    if not isinstance(document, dict):
        raise RAMInputError(
            f"{role} {path}: config.json holds a JSON {type(document).__name__}, "
            "not an object of settings. Save the model again with save_pretrained."
        )
    return document


def _architecture_names(
    reference: ModelReference, options: MergeOptions | None
) -> frozenset[str] | None:
    """The tensor names mergekit reads from a model of the base's architecture
    (aliases and tied names included); None where mergekit has no definition
    of it (it then infers one from the files: every tensor may be read)."""
    trust = options is not None and options.trust_remote_code
    try:
        config = reference.config(trust_remote_code=trust)
        architecture = arch_info_for_config(config)
        weights = [] if architecture is None else architecture.all_weights(config)
    except (OSError, ValueError, RuntimeError, KeyError, AttributeError):
        return None  # mergekit reports these itself when it plans
    names = set()
    for weight in weights:
        names.update((weight.name, *(weight.aliases or ()), *(weight.tied_names or ())))
    return frozenset(names) or None


def _local(reference: ModelReference) -> bool:
    return reference.lora is None and os.path.isdir(reference.model.path)


def _check_entries(path: str, role: str) -> None:
    """No named pipe, socket or device file: whatever reads one blocks or
    reads garbage (mergekit and transformers open files by name)."""
    for entry in os.scandir(path):
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue  # a dangling link is refused where a reader needs the file
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            regular_file(entry.path, role, path)


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
    model_config(path, role)


def _cached_snapshot(location: ModelPath, role: str, cache_dir: str | None) -> str:
    """The cached snapshot of a hub id; without the hub, there is no other source."""
    try:
        return huggingface_hub.snapshot_download(
            location.path,
            revision=location.revision,
            cache_dir=cache_dir,
            local_files_only=True,
        )
    except LocalEntryNotFoundError as error:
        cannot = (
            "with HF_HUB_OFFLINE=1 it cannot be downloaded"
            if constants.HF_HUB_OFFLINE
            else f"it cannot be downloaded: {silent_hub()}"
        )
        raise RAMInputError(
            f"{role}: {location} is not a local directory"
            f"{_relative_to(location.path)}, and not in the local Hugging Face "
            f"cache either; {cannot}. Fix the path, or download the model "
            "while online."
        ) from error


def _relative_to(path: str) -> str:
    if os.path.isabs(path):
        return ""
    return f" (relative paths start from the current directory, {os.getcwd()})"
