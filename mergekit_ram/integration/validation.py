"""Checks of a merge configuration, before any weight is read.

mergekit 0.1.5 checks parameter values only while planning (after every
checkpoint's index was opened) and lets a missing model fail deep inside
transformers or the hub client. These checks read directory listings and
the checkpoints' headers (a few kilobytes per file), so the first problem a
user must fix is reported as one RAMInputError paragraph before the merge
starts: the device options, the groups' structure (`config_groups`), the
model locations and slices' layer ranges (`model_locations`), the dtypes
(`compute_options`) and parameters (`parameter_schema`), then every input's
headers. They are cheap: every entry point may call them; the run_merge
wrapper calls `validate_config`.
"""

from __future__ import annotations

from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from mergekit_ram.integration.compute_options import check_device, check_dtypes
from mergekit_ram.integration.config_groups import check_group, groups
from mergekit_ram.integration.methods import METHODS, is_ours
from mergekit_ram.integration.model_locations import (
    check_headers,
    check_layer_ranges,
    check_location,
    check_reference,
    model_references,
)
from mergekit_ram.integration.parameter_schema import (
    check_output_range,
    check_parameters,
)


def validate_config(
    config: MergeConfiguration, options: MergeOptions | None = None
) -> None:
    """Refuse a `ram` / `ramplus` merge the user must fix; other methods pass.

    Raises RAMInputError naming the key or model and the fix.
    """
    if is_ours(config.merge_method):
        _validate(config, options, f"merge_method {config.merge_method}")


def validate_analysis(
    config: MergeConfiguration, options: MergeOptions | None = None
) -> None:
    """Refuse what `mergekit-ram analyze` cannot measure, for any merge method.

    The models must exist and form base + task models; the parameters are
    only checked for our methods, whose r / alpha / saturation analyze uses.
    """
    _validate(config, options, "mergekit-ram analyze")


def _validate(
    config: MergeConfiguration, options: MergeOptions | None, user: str
) -> None:
    check_device(options)
    found = groups(config)
    for group in found:
        check_group(group, user)
    cache_dir = options.transformers_cache if options is not None else None
    for role, reference in model_references(config, found):
        check_reference(reference, role, cache_dir)
    tokenizer = config.tokenizer.source if config.tokenizer else None
    for role, source in (
        ("tokenizer_source", config.tokenizer_source),
        ("tokenizer.source", tokenizer),
    ):
        if isinstance(source, ModelReference):
            check_location(source.model, role, cache_dir, model=False)
    check_layer_ranges(config)
    if is_ours(config.merge_method):
        check_dtypes(config)
        method = next(m for m in METHODS if m.spec.name == config.merge_method)
        check_parameters(found, method)
        check_output_range(config, found, method)
    check_headers(config, found, options)
