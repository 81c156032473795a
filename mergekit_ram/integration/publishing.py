"""A RAM merge's output folder looks complete only once the merge has finished.

mergekit's run_merge writes weight shards while it merges, then config.json,
the model card, the recipe and the tokenizer, and our planner adds
ram_statistics.json. A merge that dies half-way (an exception, Ctrl-C,
SIGKILL) would leave a folder that looks like a model, possibly the previous
run's config and card next to new partial shards. For `ram` / `ramplus`
configurations, `run_merge` is therefore wrapped so that it:

1. validates the configuration and refuses an out_path that is an input model;
2. removes what a previous merge left in out_path that marks a folder as
   complete (config.json first) and its weight files, and any staging folder
   a killed run left behind;
3. lets mergekit write the whole merge into a hidden staging folder inside
   out_path (same file system, and the same folder name, so the model card
   does not change);
4. on success moves the files up, config.json last; on any failure
   (exception or Ctrl-C) removes the staging folder and whatever it had
   already moved up, markers first.

So until the final rename out_path holds no config.json. The only window in
which a SIGKILL leaves another marker without config.json is between the
renames of the markers (a few system calls, after the whole merge); a rerun
clears it like any other leftover.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.context import merge_run
from mergekit_ram.integration.errors import ClickInputError
from mergekit_ram.integration.methods import is_ours
from mergekit_ram.integration.validation import validate_config

STAGING = ".mergekit-ram-partial"
# Files that make a folder look like a finished merge, in publishing order
# (after the shards): the weight index, ..., config.json (what loaders need).
MARKERS = (
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "ram_statistics.json",
    "mergekit_config.yml",
    "README.md",
    "config.json",
)
# mergekit's TensorWriter names: model.safetensors, model-1.safetensors (not
# yet finalized), model-00001-of-00002.safetensors, the index; also .bin.
WEIGHTS = re.compile(
    r"(model|pytorch_model)(-\d+(-of-\d+)?)?\.(safetensors|bin)(\.index\.json)?"
)


def refuse_input_folder(config: Any, out_path: str) -> None:
    """An out_path that is an input model's folder would overwrite that model."""
    if not os.path.isdir(out_path):
        return
    for reference in config.referenced_models():
        for source in (reference.model, reference.lora):
            if (
                source is not None
                and os.path.isdir(source.path)
                and os.path.samefile(source.path, out_path)
            ):
                raise RAMInputError(
                    f"The output folder {out_path} is the input model {source.path}: "
                    "the merge would overwrite it. Choose another output folder."
                )


def clear_merge(out_path: str) -> None:
    """Remove a merge's completion markers (config.json first), its weight
    shards, then the staging folder: before a merge starts (a previous
    run's), and after one failed (what it had published)."""
    names = os.listdir(out_path)
    stale = [m for m in reversed(MARKERS) if m in names]
    stale += [n for n in names if WEIGHTS.fullmatch(n) and n not in MARKERS]
    for name in stale:
        os.remove(os.path.join(out_path, name))
    shutil.rmtree(os.path.join(out_path, STAGING), ignore_errors=True)


def publish(staged: str, out_path: str) -> None:
    """Move the finished merge up into out_path, completion markers last."""
    names = os.listdir(staged)
    rank = {name: index for index, name in enumerate(MARKERS)}
    for name in sorted(names, key=lambda n: rank.get(n, -1)):
        os.replace(os.path.join(staged, name), os.path.join(out_path, name))


def guarded_run_merge(original: Callable[..., Any]) -> Callable[..., Any]:
    """mergekit's run_merge with the staging above for RAM / RAM+ configs."""

    def run_merge(
        merge_config: Any,
        out_path: str,
        options: Any,
        config_source: str | None = None,
    ) -> Any:
        if not is_ours(merge_config.merge_method):
            return original(
                merge_config, out_path, options=options, config_source=config_source
            )
        try:
            with merge_run():
                _staged_merge(original, merge_config, out_path, options, config_source)
        except ClickInputError:
            raise
        except RAMInputError as error:
            # mergekit-yaml is a click command: print it as `Error: ...`, exit 2.
            raise ClickInputError(str(error)) from error

    run_merge.__mergekit_ram__ = original
    return run_merge


def _staged_merge(
    original: Callable[..., Any],
    merge_config: Any,
    out_path: str,
    options: Any,
    config_source: str | None,
) -> None:
    """Steps 1 to 4 above."""
    validate_config(merge_config, options)
    refuse_input_folder(merge_config, out_path)
    os.makedirs(out_path, exist_ok=True)
    clear_merge(out_path)
    root = os.path.join(out_path, STAGING)
    staged = os.path.join(root, os.path.basename(os.path.abspath(out_path)))
    os.makedirs(staged)
    try:
        original(merge_config, staged, options=options, config_source=config_source)
        publish(staged, out_path)
    except BaseException:
        clear_merge(out_path)
        raise
    shutil.rmtree(root)
