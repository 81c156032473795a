"""Python entry points with the same signatures as mergekit's.

They differ from mergekit's own in making global RAM+ work: the in-memory
functions count the whole input before merging and pass λ as `unique_scale`;
`run_merge` keeps the caller's configuration and recipe intact (the planner
hook does the counting, the run_merge wrapper the staging). The in-memory
functions refuse an input that is not a tensor with data (None, a list, a
numpy array, a meta tensor) as a RAMInputError naming it; for `ram` /
`ramplus` they also check every tensor group's layout and dtype first and
take integer / bool buffers from the base model, as a config merge does.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import yaml
from mergekit import merge as mergekit_merge
from mergekit import merge_methods
from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration
from mergekit.merge_methods import MergeMethod, PerGroupValues
from mergekit.options import MergeOptions

from mergekit_ram.core.checks import finite_inputs, from_base, uncomputable
from mergekit_ram.core.counting import OverlapStatistics, group_tensors
from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.core.parallel import workers
from mergekit_ram.core.settings import (
    SCALAR_KEYS,
    MergeSettings,
    one_value_error,
    varying_key,
)
from mergekit_ram.integration.cpus import usable_cpus
from mergekit_ram.integration.install import install
from mergekit_ram.integration.methods import RAMMerge

StateDictLike = Mapping[str, torch.Tensor] | torch.nn.Module
T = TypeVar("T")


def run_merge(
    merge_config: MergeConfiguration,
    out_path: str,
    options: MergeOptions,
    config_source: str | None = None,
) -> None:
    """mergekit's run_merge, leaving `merge_config` untouched.

    mergekit rewrites the configuration it is given while planning; this works
    on a deep copy and records the caller's recipe in mergekit_config.yml. A
    RAM / RAM+ configuration is validated first (RAMInputError), before any
    weight is read, by the run_merge wrapper (integration.publishing).
    """
    install()
    _expect("merge_config", merge_config, MergeConfiguration, CONFIG_HINT)
    _expect("options", options, MergeOptions, "MergeOptions() for the defaults")
    if not isinstance(out_path, (str, bytes, os.PathLike)):
        raise RAMInputError(
            f"run_merge: out_path is {_kind(out_path)}, not a path. Pass the "
            "folder to write the merge into, e.g. './merged'."
        )
    if config_source is None:
        config_source = recipe_yaml(merge_config)
    # Through the module attribute: install() put the staging wrapper there.
    mergekit_merge.run_merge(
        merge_config.model_copy(deep=True),
        os.fsdecode(out_path),
        options=options,
        config_source=config_source,
    )


CONFIG_HINT = (
    "MergeConfiguration.model_validate(yaml.safe_load(text)), or "
    "MergeConfiguration.model_validate(a_dict)"
)


def _kind(value: Any) -> str:
    """A value's type as a message names it: None, a dict, a numpy.ndarray."""
    if value is None:
        return "None"
    kind = type(value)
    name = kind.__qualname__
    return (
        f"a {name}" if kind.__module__ == "builtins" else f"a {kind.__module__}.{name}"
    )


def _expect(name: str, value: Any, kind: type, hint: str) -> None:
    if not isinstance(value, kind):
        raise RAMInputError(
            f"run_merge: {name} is {_kind(value)}, not a {kind.__name__}. Pass {hint}."
        )


def recipe_yaml(config: MergeConfiguration) -> str:
    """The configuration as YAML text, for mergekit_config.yml.

    mergekit 0.1.5's `to_yaml` fails on a model path holding a space or a
    double quote (its serializer hands back the reference itself: "Circular
    reference detected"); there, each reference is written as its text,
    which parses back to the same reference.
    """
    try:
        return config.to_yaml()
    except ValueError:
        dumped = config.model_dump(mode="python", exclude_defaults=True)
        return yaml.safe_dump(_as_text(dumped), sort_keys=False)


def _as_text(value: Any) -> Any:
    """`value` with every ModelReference replaced by its text."""
    if isinstance(value, ModelReference):
        return str(value)
    if isinstance(value, dict):
        return {key: _as_text(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_text(item) for item in value]
    return value


def _method(method: str | MergeMethod) -> MergeMethod:
    install()
    return merge_methods.get(method) if isinstance(method, str) else method


def _shared(
    method: RAMMerge, parameters: Mapping[str, Any], name: str, index: int
) -> Any:
    """A shared parameter's validated value for tensor group `index`."""
    spec = next(p for p in method.spec.parameters if p.name == name)
    value = parameters.get(name, spec.default)
    if isinstance(value, PerGroupValues):
        value = value.values[index]
    return spec.validate(value)


def _settings(method: RAMMerge, parameters: Mapping[str, Any]) -> MergeSettings:
    """The merge's settings; global statistics need one value per key."""
    values = {}
    for key in SCALAR_KEYS:
        value = parameters.get(key)
        groups = value.values if isinstance(value, PerGroupValues) else (value,)
        values[key] = {_shared(method, parameters, key, i) for i in range(len(groups))}
    key = varying_key(values)
    if key is not None:
        raise one_value_error(key, "varies per tensor group")
    return MergeSettings(
        **{key: _shared(method, parameters, key, 0) for key in SCALAR_KEYS}
    )


def _check_inputs(
    where: str, tensors: Iterable[tuple[Hashable, Any]], ours: bool
) -> None:
    """Each (label, input) is a torch.Tensor holding data; for RAM, in a
    dtype torch computes in. `where` and the label name it in the message."""
    for label, tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise RAMInputError(
                f"{where}: {label} is {_kind(tensor)}, not a torch.Tensor. Pass "
                "tensors (torch.as_tensor converts a list or numpy array)."
            )
        if tensor.is_meta:
            raise RAMInputError(
                f"{where}: {label} is a meta tensor, which has a shape but "
                "no values to merge. Load or materialize its weights first."
            )
        problem = uncomputable(tensor.dtype) if ours else None
        if problem:
            raise RAMInputError(
                f"{where}: {label} is {tensor.dtype}, which {problem}. "
                "Convert it to bfloat16, float16 or float32 first."
            )


def _explicit(value: Any, task_ids: Sequence[Hashable]) -> dict[Hashable, Any]:
    if isinstance(value, Mapping):
        return {task: value.get(task) for task in task_ids}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return dict(zip(task_ids, value))
    return {task: value for task in task_ids}


def _checked_parameters(
    method: MergeMethod,
    parameters: Mapping[str, Any] | None,
    groups: Iterable[tuple[str, Mapping[Hashable, torch.Tensor]]],
    ids: Sequence[Hashable],
    base: Hashable | None,
    dtype: torch.dtype | None,
) -> Mapping[str, Any] | None:
    """Check every group's layout; for global RAM+ add whole-input λ.

    The layout check runs before mergekit's own so that a mismatch is a
    RAMInputError naming the models; where RAM+ needs whole-input statistics
    the same loop counts (after the `nonfinite` rule, as the kernel sees
    the inputs) and λ is passed on as unique_scale.
    """
    if not isinstance(method, RAMMerge) or base is None or base not in ids:
        return parameters
    parameters = dict(parameters or {})
    settings = _settings(method, parameters)
    task_ids = [i for i in ids if i != base]
    explicit = _explicit(parameters.get("unique_scale"), task_ids)
    if isinstance(parameters.get("unique_scale"), Mapping):
        # A model left out of the mapping has no explicit λ, in every scope.
        parameters["unique_scale"] = explicit
    counting = settings.needs_pass(task_ids, explicit)
    stats = OverlapStatistics(epsilon=settings.epsilon)
    with torch.no_grad():
        for index, (name, tensors) in enumerate(groups):
            if counting and dtype is not None:
                tensors = {i: t.to(dtype) for i, t in tensors.items()}
            group = group_tensors(tensors, base, ids, None, name=name)
            if counting and group is not None:
                nonfinite = _shared(method, parameters, "nonfinite", index)
                stats.add(name, group[0], finite_inputs(name, base, *group, nonfinite))
    if counting:
        scales = stats.scales(settings.rule, explicit)
        parameters["unique_scale"] = {t: scales.get(t, 1.0) for t in task_ids}
    return parameters


def _base_buffers(
    dicts: Mapping[Hashable, Mapping[str, torch.Tensor]], base: Hashable
) -> dict[Hashable, dict[str, torch.Tensor]]:
    """The state dicts with every model's copy of a non-float base buffer
    replaced by the base's, so mergekit's copy-if-equal rule copies the base's
    (RAM has no task vector for integer or bool buffers)."""
    buffers = {n: t for n, t in dicts[base].items() if from_base(t.dtype)}
    return {
        key: {n: buffers.get(n, t) for n, t in state.items()}
        for key, state in dicts.items()
    }


def _pooled(function: Callable[..., T]) -> Callable[..., T]:
    """One pool of worker threads for the whole call (its count and its
    merge), sized for the CPUs this process may use."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> T:
        with workers(usable_cpus()):
            return function(*args, **kwargs)

    return call


@_pooled
def merge_tensors(
    tensors: Sequence[torch.Tensor],
    method: str | MergeMethod,
    *,
    parameters: Mapping[str, Any] | None = None,
    ids: Sequence[Hashable] | None = None,
    base_index: int | None = None,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """mergekit's merge_tensors; for global RAM+ the one tensor is the whole input.

    With RAM, a non-float base (an integer or bool buffer) is returned as the
    base has it, as in a config merge (mergekit would promote it to the task
    tensors' float dtype and merge).
    """
    method = _method(method)
    ids = list(range(len(tensors))) if ids is None else list(ids)
    if len(ids) != len(tensors):
        raise RAMInputError(
            f"merge_tensors: {len(tensors)} tensors but {len(ids)} ids. Give "
            "one id per tensor, or none."
        )
    if base_index is not None and not 0 <= base_index < len(tensors):
        raise RAMInputError(
            f"merge_tensors: base_index {base_index} names no tensor: there are "
            f"{len(tensors)} (indices 0 to {len(tensors) - 1}). Pass the base "
            "tensor's position in `tensors`, or None."
        )
    ours = isinstance(method, RAMMerge)
    _check_inputs(
        "merge_tensors", ((f"input {i}", t) for i, t in zip(ids, tensors)), ours
    )
    base = ids[base_index] if base_index is not None else None
    if ours and base is not None and from_base(tensors[base_index].dtype):
        return tensors[base_index].clone()
    parameters = _checked_parameters(
        method,
        parameters,
        [(name or "tensor", dict(zip(ids, tensors)))],
        ids,
        base,
        dtype,
    )
    return merge_methods.merge_tensors(
        tensors,
        method,
        parameters=parameters,
        ids=ids,
        base_index=base_index,
        name=name,
        dtype=dtype,
        out_dtype=out_dtype,
    )


@_pooled
def merge_state_dicts(
    models: Mapping[Hashable, StateDictLike] | Sequence[StateDictLike],
    method: str | MergeMethod,
    *,
    parameters: Mapping[str, Any] | None = None,
    base: Hashable | None = None,
    strict: bool = True,
    dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    batch_options: merge_methods.BatchOptions | None = None,
) -> dict[str, torch.Tensor]:
    """mergekit's merge_state_dicts; global RAM+ counts every common tensor first."""
    method = _method(method)
    items = (
        list(models.items()) if isinstance(models, Mapping) else list(enumerate(models))
    )
    dicts = {
        key: m.state_dict(keep_vars=True) if isinstance(m, torch.nn.Module) else m
        for key, m in items
    }
    ids = list(dicts)
    for key, state in dicts.items():
        if isinstance(state, Mapping):
            _check_inputs(
                f"merge_state_dicts: model {key!r}",
                ((f"tensor {n}", t) for n, t in state.items()),
                isinstance(method, RAMMerge),
            )
    names = (
        [n for n in dicts[ids[0]] if all(n in d for d in dicts.values())] if ids else []
    )
    parameters = _checked_parameters(
        method,
        parameters,
        ((n, {i: dicts[i][n] for i in ids}) for n in names),
        ids,
        base,
        dtype,
    )
    if isinstance(method, RAMMerge) and base in dicts:
        models = _base_buffers(dicts, base)
    return merge_methods.merge_state_dicts(
        models,
        method,
        parameters=parameters,
        base=base,
        strict=strict,
        dtype=dtype,
        out_dtype=out_dtype,
        batch_options=batch_options,
    )
