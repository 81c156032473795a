"""A RAM merge never costs the user a file (see mergekit_ram.publishing).

For `ram` / `ramplus` configurations mergekit's run_merge is wrapped so that
it validates the configuration and the input headers, refuses an output
folder that would change an input, and lets mergekit write into a private
staging folder that is published into out_path only once the whole merge
succeeded. mergekit's model card may ask the hub about a relative path
(`in/base`), which fails offline after the whole merge was computed; the
card is then written without that link (mergekit_ram.install.patch_card).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from mergekit_ram.errors import RAMInputError
from mergekit_ram.method import is_ours
from mergekit_ram.paths import output_conflict
from mergekit_ram.publishing import OutputError, staged_merge
from mergekit_ram.validation import validate_config


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


def refuse_input_folder(config: Any, out_path: str) -> None:
    """OUT may not be, or lie inside, an input; no input file may link into it."""
    problem = output_conflict(out_path, _inputs(config))
    if problem:
        raise RAMInputError(
            f"{problem}: the merge would overwrite it. Choose another output folder."
        )


def guarded_run_merge(original: Callable[..., Any]) -> Callable[..., Any]:
    """mergekit's run_merge, checked and published by swap for RAM / RAM+."""

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
        validate_config(merge_config, options)
        refuse_input_folder(merge_config, out_path)
        try:
            staged_merge(
                out_path,
                lambda staged: original(
                    merge_config, staged, options=options, config_source=config_source
                ),
            )
        except OutputError as error:
            raise RAMInputError(str(error)) from None

    run_merge.__mergekit_ram__ = original
    return run_merge
