"""mergekit's run_merge for RAM merges: checked first, published file by file.

For `ram` / `ramplus` configurations `run_merge` is wrapped so that it
takes OUT's lock (removing a killed run's staging), checks the configuration
and every input's checkpoint headers (`validation`), refuses an output
folder that would change an input (OUT equal to or inside an input, or
holding a file an input reads), then lets mergekit write the whole merge
into our staging folder inside OUT, which `output_folder` publishes into
out_path only once the merge succeeded. One `context.MergeRun` is open for
the merge, so the planner's statistics reach the model card and nothing
outlives it. Any other method mergekit knows runs as mergekit's own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from mergekit.merge_methods import registry

from mergekit_ram.core.errors import RAMInputError
from mergekit_ram.integration.checkpoints import output_conflict
from mergekit_ram.integration.context import current_run, merge_run
from mergekit_ram.integration.errors import click_errors
from mergekit_ram.integration.host import bound
from mergekit_ram.integration.methods import is_ours
from mergekit_ram.integration.output_folder import staged_merge
from mergekit_ram.integration.validation import (
    DuplicateKey,
    check_config,
    written_document,
)


def _inputs(config: Any) -> Iterator[tuple[str, str]]:
    """(role, path) of every folder the merge reads: models, LoRAs, tokenizers."""
    for reference in config.referenced_models():
        yield "model", reference.model.path
        if reference.lora is not None:
            yield "LoRA", reference.lora.path
    tokenizer = config.tokenizer.source if config.tokenizer else None
    for role, source in (
        ("tokenizer_source", config.tokenizer_source),
        ("tokenizer.source", tokenizer),
    ):
        path = getattr(getattr(source, "model", None), "path", None)
        if path is not None:
            yield role, path


def refuse_input_folder(config: Any, folder: str, role: str = "output folder") -> None:
    """A folder we write (OUT, a report folder) may not be or lie inside an
    input, nor hold a file an input reads."""
    problem = output_conflict(folder, _inputs(config), role)
    if problem:
        raise RAMInputError(
            f"{problem}: writing there would change an input. Choose another {role}."
        )


def written(config_source: str | None) -> Any:
    """The configuration as the user wrote it (its keys are checked: mergekit
    drops the ones it does not read), where the caller passed its text."""
    try:
        return None if config_source is None else written_document(config_source)
    except DuplicateKey as error:
        raise RAMInputError(f"The configuration: {error.problem}.") from None
    except yaml.YAMLError:
        return None  # mergekit parsed it already; nothing more to learn here


def guarded_run_merge(original: Callable[..., Any]) -> Callable[..., Any]:
    """mergekit's run_merge, checked and published file by file for RAM / RAM+;
    for any other method mergekit knows, mergekit's own, arguments untouched."""

    def run_merge(*args: Any, **kwargs: Any) -> Any:
        merge_config = args[0] if args else kwargs.get("merge_config")
        method = getattr(merge_config, "merge_method", None)
        known = method in {m.spec.name for m in registry.registered_methods()}
        if known and not is_ours(method):
            return original(*args, **kwargs)
        call = bound(original, args, kwargs)
        out_path, options = call.arguments["out_path"], call.arguments["options"]
        config_source = call.arguments.get("config_source")

        def merge(staged: str) -> Any:
            call.arguments["out_path"] = staged
            return original(*call.args, **call.kwargs)

        def check() -> None:
            run = current_run()
            run.findings = check_config(merge_config, options, written(config_source))
            refuse_input_folder(merge_config, out_path)

        with click_errors():  # mergekit-yaml is a click command: `Error: ...`, exit 2
            if not known:  # refused before OUT is touched, with the file's problems
                check_config(merge_config, options, written(config_source))
            with merge_run() as run:
                run.card_name = os.path.basename(out_path)  # as stock names it
                staged_merge(out_path, merge, check)

    return run_merge
