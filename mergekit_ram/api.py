"""Python entry points with the same signatures as mergekit's.

They differ from mergekit's own only in making global RAM+ work: the
in-memory functions count the whole input before merging and pass λ as
`unique_scale`; `run_merge` keeps the caller's configuration and recipe intact
(the planner hook does the counting).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from mergekit import merge_methods
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge as mergekit_run_merge
from mergekit.merge_methods import MergeMethod, PerGroupValues
from mergekit.options import MergeOptions

from mergekit_ram.install import install
from mergekit_ram.method import RAMMerge
from mergekit_ram.settings import SCALAR_KEYS, MergeSettings
from mergekit_ram.statistics import OverlapStatistics, group_tensors
from mergekit_ram.validation import validate_config

StateDictLike = Mapping[str, torch.Tensor] | torch.nn.Module


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
    weight is read.
    """
    install()
    validate_config(merge_config, options)
    if config_source is None:
        config_source = merge_config.to_yaml()
    mergekit_run_merge(
        merge_config.model_copy(deep=True),
        out_path,
        options=options,
        config_source=config_source,
    )


def _method(method: str | MergeMethod) -> MergeMethod:
    install()
    return merge_methods.get(method) if isinstance(method, str) else method


def _settings(method: RAMMerge, parameters: Mapping[str, Any]) -> MergeSettings:
    values = {}
    for spec in method.spec.parameters:
        if spec.name not in SCALAR_KEYS:
            continue
        value = parameters.get(spec.name, spec.default)
        if isinstance(value, PerGroupValues):
            if len(set(value.values)) > 1:
                raise ValueError(
                    f"'{spec.name}' varies per tensor group, but whole-model "
                    "statistics need one value: pass a scalar or set "
                    "statistics='tensor'."
                )
            value = value.values[0]
        values[spec.name] = spec.validate(value)
    return MergeSettings(**values)


def _explicit(value: Any, task_ids: Sequence[Hashable]) -> dict[Hashable, Any]:
    if isinstance(value, Mapping):
        return {task: value.get(task) for task in task_ids}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return dict(zip(task_ids, value))
    return {task: value for task in task_ids}


def _with_global_scales(
    method: MergeMethod,
    parameters: Mapping[str, Any] | None,
    groups: Iterable[tuple[str, Mapping[Hashable, torch.Tensor]]],
    ids: Sequence[Hashable],
    base: Hashable | None,
    dtype: torch.dtype | None,
) -> Mapping[str, Any] | None:
    """Parameters with whole-input λ as unique_scale, where RAM+ needs them."""
    if not isinstance(method, RAMMerge) or base is None or base not in ids:
        return parameters
    parameters = dict(parameters or {})
    settings = _settings(method, parameters)
    task_ids = [i for i in ids if i != base]
    explicit = _explicit(parameters.get("unique_scale"), task_ids)
    if isinstance(parameters.get("unique_scale"), Mapping):
        # A model left out of the mapping has no explicit λ, in every scope.
        parameters["unique_scale"] = explicit
    if not settings.needs_pass(task_ids, explicit):
        return parameters
    stats = OverlapStatistics(epsilon=settings.epsilon)
    with torch.no_grad():
        for name, tensors in groups:
            if dtype is not None:
                tensors = {i: t.to(dtype) for i, t in tensors.items()}
            group = group_tensors(tensors, base, ids, None)
            if group is not None:
                stats.add(name, *group)
    scales = stats.scales(settings.rule, explicit)
    parameters["unique_scale"] = {task: scales.get(task, 1.0) for task in task_ids}
    return parameters


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
    """mergekit's merge_tensors; for global RAM+ the one tensor is the whole input."""
    method = _method(method)
    ids = list(range(len(tensors))) if ids is None else list(ids)
    base = ids[base_index] if base_index is not None else None
    parameters = _with_global_scales(
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
        key: m.state_dict() if isinstance(m, torch.nn.Module) else m for key, m in items
    }
    ids = list(dicts)
    names = (
        [n for n in dicts[ids[0]] if all(n in d for d in dicts.values())] if ids else []
    )
    parameters = _with_global_scales(
        method,
        parameters,
        ((n, {i: dicts[i][n] for i in ids}) for n in names),
        ids,
        base,
        dtype,
    )
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
