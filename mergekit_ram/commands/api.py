"""Python entry points with the same signatures as mergekit's.

Global RAM+ works through mergekit's own entry points too (the method
counts every group of an in-memory call before merging, the planner hook a
config merge's). These differ from mergekit's own in that `run_merge` keeps
the caller's configuration and recipe intact, and, for `ram` / `ramplus`,
the in-memory functions take integer / bool buffers from the base model, as
a config merge does; each call gets one pool of worker threads.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import yaml
from mergekit import merge as mergekit_merge
from mergekit import merge_methods
from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration
from mergekit.merge_methods import MergeMethod
from mergekit.options import MergeOptions

from mergekit_ram.commands.install import install
from mergekit_ram.core.checks import from_base
from mergekit_ram.core.parallel import workers
from mergekit_ram.integration.methods import RAMMerge

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
    weight is read, by the run_merge wrapper (integration.publishing).
    """
    install()
    source = recipe_yaml(merge_config) if config_source is None else config_source
    # Through the module attribute: install() put the staging wrapper there.
    mergekit_merge.run_merge(
        merge_config.model_copy(deep=True),
        os.fsdecode(out_path),
        options=options,
        config_source=source,
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


# `workers()` as a decorator (contextlib's): one pool of worker threads for
# each whole call (its count and its merge), sized for the CPUs this process
# may use.
@workers()
def merge_tensors(
    tensors: Sequence[torch.Tensor], method: str | MergeMethod, **options: Any
) -> torch.Tensor:
    """mergekit's merge_tensors, with its keyword arguments.

    With RAM, a non-float base (an integer or bool buffer) is returned as the
    base has it, as in a config merge (mergekit would promote it to the task
    tensors' float dtype and merge).
    """
    method = _method(method)
    index = options.get("base_index")
    base = tensors[index] if index in range(len(tensors)) else None
    if isinstance(method, RAMMerge) and base is not None and from_base(base.dtype):
        return base.clone()
    return merge_methods.merge_tensors(tensors, method, **options)


@workers()
def merge_state_dicts(
    models: Mapping[Hashable, StateDictLike] | Sequence[StateDictLike],
    method: str | MergeMethod,
    **options: Any,
) -> dict[str, torch.Tensor]:
    """mergekit's merge_state_dicts, with its keyword arguments (global RAM+
    counts every tensor first).

    With RAM, every model's copy of a non-float base buffer is replaced by
    the base's, so mergekit's copy-if-equal rule copies the base's (RAM has
    no task vector for integer or bool buffers), as in a config merge.
    """
    method = _method(method)
    items = models.items() if isinstance(models, Mapping) else enumerate(models)
    dicts = {
        key: m.state_dict(keep_vars=True) if isinstance(m, torch.nn.Module) else m
        for key, m in items
    }
    base = options.get("base")
    if isinstance(method, RAMMerge) and base in dicts:
        buffers = {n: t for n, t in dicts[base].items() if from_base(t.dtype)}
        models = {
            key: {n: buffers.get(n, t) for n, t in state.items()}
            for key, state in dicts.items()
        }
    return merge_methods.merge_state_dicts(models, method, **options)
