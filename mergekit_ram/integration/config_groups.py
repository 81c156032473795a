"""A mergekit configuration as the groups of models it merges, with their parameters.

mergekit resolves a parameter per tensor from the first matching mapping:
a model's own, then its slice's or module's, then the top level. The
validation walks the configuration in that shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mergekit.common import ModelReference
from mergekit.config import (
    InputModelDefinition,
    MergeConfiguration,
    OutputSliceDefinition,
)

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import first_duplicate, identity


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


def groups(config: MergeConfiguration) -> list[Group]:
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


def check_group(group: Group, user: str) -> None:
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


def check_one_base(base: ModelReference | None, found: list[Group], user: str) -> None:
    """Every group measured against the configuration's one base model:
    RAM's task vectors, its statistics, the report and the card all name one
    (a slice's own `base_model` would merge that slice against another)."""
    named = [("base_model", base)] if base is not None else []
    named += [(group.label, group.base) for group in found if group.base is not None]
    for label, other in named[1:]:
        if other != named[0][1]:
            raise RAMInputError(
                f"{label}: its base model {other} differs from {named[0][1]}, "
                f"the {named[0][0]}. {user} measures every task vector against "
                "one base model, the one the task models were fine-tuned from: "
                "remove that slice's base_model, or make it the same."
            )


def _spelled(reference: ModelReference) -> str:
    """A reference's path, with its LoRA (a different model when it has one)."""
    lora = "" if reference.lora is None else f"+{identity(reference.lora.path)}"
    return reference.model.path + lora
