"""Checks of a `ram` / `ramplus` configuration's parameters against the method's spec.

mergekit 0.1.5 ignores parameter names it does not know and checks values
only while planning (with a pydantic traceback). Here every key is checked
against the method's ParameterSpecs (name, scope) and every value against its
own pydantic type, the one definition of what is allowed, reformatted into
one paragraph naming the key and the fix. The λ those values allow must
also fit the output dtype (`check_output_range`); the command-line numbers
pass the same `number_problem`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, get_args, get_origin

import torch
from mergekit.common import dtype_from_name
from mergekit.config import ConditionalParameter, MergeConfiguration
from mergekit.merge_methods.base import ParameterScope, ParameterSpec
from pydantic import ValidationError

from mergekit_ram.core.errors import Problems, RAMInputError
from mergekit_ram.core.scale import ScaleRule
from mergekit_ram.core.settings import (
    SCALAR_KEYS,
    one_value_error,
    unique_scale_error,
    varying_key,
)
from mergekit_ram.integration.config_groups import Block, Group
from mergekit_ram.integration.methods import PARAMETER_HELP, RAMMerge

RESCALE_FACTOR_HINT = (
    "The authors' --rescale_factor R is r = R − 1 here: their arm-r-v2 is "
    "r: R − 1 with alpha: 1, their arm-r is r: R − 1 with saturation: soft "
    "(R = 1.2 is r: 0.2)."
)


def check_parameters(groups: list[Group], method: RAMMerge, problems: Problems) -> None:
    """Every parameters mapping's keys and values against the method's spec;
    each problem goes to `problems`. The rules across mappings (one value
    for global statistics, ONLY_WITH) run once the values are right."""
    specs = {spec.name: spec for spec in method.spec.parameters}
    name = method.spec.name
    before = len(problems.found)
    for block in _unique_blocks(groups):
        for key, setting in block.settings.items():
            with problems.check():
                spec = specs.get(key)
                if spec is None:
                    raise _unknown(block, key, name, specs)
                _check_scope(block, spec)
                if _empty(setting):
                    raise RAMInputError(
                        f"{block.where(key)}: an empty list gives {key} no "
                        "value, and mergekit would silently use the default. "
                        "Write a value or remove the key."
                    )
                for value in _leaves(setting):
                    _check_value(block, spec, value)
    if len(problems.found) == before:
        with problems.check():
            _check_one_value(groups, specs)
        for rule in ONLY_WITH:
            with problems.check():
                _check_only_with(groups, specs, *rule)


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
    upper = _upper_bound(spec)
    problem = number_problem(spec, value)
    if problem:
        limits = "≥ 0" if upper is None else f"between 0 and {upper:g}"
        raise RAMInputError(
            f"{block.where(spec.name)}: {value!r} {problem}; {spec.name} "
            f"({PARAMETER_HELP[spec.name]}) must be a finite number {limits}."
        )


def _upper_bound(spec: ParameterSpec) -> float | None:
    """The `le` bound in the parameter's own Annotated type, else None."""
    for meta in getattr(spec.value_type, "__metadata__", ()):
        for item in getattr(meta, "metadata", ()):
            if getattr(item, "le", None) is not None:
                return float(item.le)
    return None


def _choices(spec: ParameterSpec) -> tuple[str, ...]:
    """The allowed strings of a Literal-typed parameter, else ()."""
    if get_origin(spec.value_type) is Literal:
        return get_args(spec.value_type)
    return ()


def number_problem(spec: ParameterSpec, value: Any) -> str:
    """Why the parameter's own type refuses `value`, in our words ('' if not)."""
    try:
        spec.validate(value)
    except ValidationError as error:
        kind = error.errors()[0]["type"]
    else:
        return ""
    if kind == "greater_than_equal":
        return "is negative"
    if kind == "less_than_equal":
        return f"is above {_upper_bound(spec):g}"
    if kind == "finite_number":
        return "is NaN" if math.isnan(float(value)) else "is infinite"
    return "is not a number"


def check_output_range(
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
    key = varying_key(values)
    if key is not None:
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


# Settings that act only beside another one's value: set where that value is
# never used, they would be ignored (and still shown in the card).
ONLY_WITH = (
    ("density", "shared", "ties", "TIES on the shared elements"),
    ("alpha", "saturation", "clip", "the clip rule's cap on S/U"),
)


def _check_only_with(
    groups: list[Group],
    specs: Mapping[str, ParameterSpec],
    key: str,
    partner: str,
    value: str,
    what: str,
) -> None:
    """A rule of ONLY_WITH: `key` set where `partner` never takes `value` is
    refused, since it would be ignored."""
    if any(value in _possible(specs[partner], g.blocks) for g in groups):
        return
    for block in _unique_blocks(groups):
        if key in block.settings:
            raise RAMInputError(
                f"{block.where(key)}: {key} only applies with {partner}: "
                f"{value} ({what}), and this merge never uses it, so it would "
                f"be ignored. Add '{partner}: {value}' next to it, or remove {key}."
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
