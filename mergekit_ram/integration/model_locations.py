"""Whether each model folder a configuration names can be loaded, before loading it.

A local model folder must hold weights mergekit can load and a valid
config.json; a slice's layer_range must lie within its model. A name that is
no local path but is spelled like a hub id is mergekit's to fetch (or to
fail on).
"""

from __future__ import annotations

import errno
import json
import os

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from mergekit.architecture import arch_info_for_config
from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import WEIGHT_FILES, regular_file


def local(reference: ModelReference) -> bool:
    """A model (no LoRA) in a local folder: its headers can be read here."""
    return reference.lora is None and os.path.isdir(reference.model.path)


def check_location(path: str, role: str, *, model: bool = False) -> None:
    """A local folder (with weights and config.json, for a `model`), or a
    name mergekit would look up on the hub."""
    if os.path.isdir(path):
        if model:
            _check_model_folder(path, role)
        return
    if os.path.exists(path):
        raise RAMInputError(
            f"{role}: {path} is a file; mergekit needs the model's directory "
            "(config.json and its weights)."
        )
    unreachable = None
    try:
        os.stat(path)
    except OSError as error:
        if error.errno == errno.ELOOP:
            unreachable = "is (or lies under) a symlink loop"
    if os.path.islink(path) and not unreachable:
        unreachable = f"is a symlink to {os.readlink(path)}, which does not exist"
    if not unreachable and _hub_id(path):
        return  # mergekit downloads it
    relative = (
        ""
        if os.path.isabs(path)
        else f" (relative paths start from the current directory, {os.getcwd()})"
    )
    raise RAMInputError(
        f"{role}: {path} {unreachable or 'does not exist'}{relative}. Fix the "
        "path, or create the model there first."
    )


def _hub_id(path: str) -> bool:
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _check_model_folder(path: str, role: str) -> None:
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


def architecture_names(
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


def check_layer_ranges(config: MergeConfiguration) -> None:
    """Every top-level slice's layer_range lies within its local model's
    layers (num_hidden_layers of its config.json); mergekit would fail on
    the first missing layer's tensor, after the merge started."""
    for index, output in enumerate(config.slices or ()):
        for number, source in enumerate(output.sources):
            if source.layer_range is None or not local(source.model):
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
