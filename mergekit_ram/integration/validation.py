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

import difflib
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

import yaml
from mergekit.common import ModelReference
from mergekit.config import ConditionalParameter, MergeConfiguration
from mergekit.merge_methods import registry
from mergekit.options import MergeOptions
from pydantic import BaseModel

from mergekit_ram.core.errors import Problems, RAMInputError
from mergekit_ram.integration.compute_options import check_device, check_dtypes
from mergekit_ram.integration.config_groups import check_group, check_one_base, groups
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
    config: MergeConfiguration,
    options: MergeOptions | None = None,
    document: Any = None,
) -> None:
    """Refuse a `ram` / `ramplus` merge the user must fix; other methods pass,
    unless mergekit does not know the method at all.

    `document` is the YAML as written, where there is one: its keys are
    checked too (mergekit drops the ones it does not read). Raises one
    RAMInputError listing every problem, each naming the key or model and
    the fix.
    """
    problem, method = _method(config.merge_method)
    if is_ours(method):
        _validate(config, options, f"merge_method {method}", document, method, problem)


def validate_analysis(
    config: MergeConfiguration,
    options: MergeOptions | None = None,
    document: Any = None,
) -> None:
    """Refuse what `mergekit-ram analyze` cannot measure, for any merge method.

    The models must exist and form base + task models; the parameters and
    keys are only checked for our methods, whose r / alpha / saturation
    analyze uses; a method mergekit does not know is refused.
    """
    problem, method = _method(config.merge_method)
    _validate(config, options, "mergekit-ram analyze", document, method, problem)


def _method(method: Any) -> tuple[str | None, str]:
    """(why mergekit would not know `merge_method`, the method to check the
    rest of the file as): a misspelling of ours is checked as the method it
    means, so its problem is reported with every other one; any other
    unknown name is refused alone."""
    problem = method_problem(method)
    if problem is None:
        return None, method
    meant = _closest(str(method), [m.spec.name for m in METHODS])
    if meant is None or _closest(str(method), _known_methods()) != meant:
        raise RAMInputError(problem)
    return problem, meant


def _validate(
    config: MergeConfiguration,
    options: MergeOptions | None,
    user: str,
    document: Any,
    method_name: str,
    method_error: str | None,
) -> None:
    """Every check, each problem kept: the user fixes them all in one go.
    The headers are read only once the rest is right (they need the models)."""
    problems = Problems("The configuration")
    if method_error is not None:
        problems.add(method_error)
    ours = is_ours(method_name)
    if ours and document is not None:
        for problem in key_problems(document, method_name):
            problems.add(problem)
    with problems.check():
        check_device(options)
    found = groups(config)
    for group in found:
        with problems.check():
            check_group(group, user)
    with problems.check():
        check_one_base(config.base_model, found, user)
    cache_dir = options.transformers_cache if options is not None else None
    for role, reference in model_references(config, found):
        with problems.check():
            check_reference(reference, role, cache_dir)
    tokenizer = config.tokenizer.source if config.tokenizer else None
    for role, source in (
        ("tokenizer_source", config.tokenizer_source),
        ("tokenizer.source", tokenizer),
    ):
        if isinstance(source, ModelReference):
            with problems.check():
                check_location(source.model, role, cache_dir, model=False)
    with problems.check():
        check_layer_ranges(config)
    if ours:
        with problems.check():
            check_dtypes(config)
        method = next(m for m in METHODS if m.spec.name == method_name)
        check_parameters(found, method, problems)
        if not problems.found:
            with problems.check():
                check_output_range(config, found, method)
    if not problems.found:
        with problems.check():
            check_headers(config, found, options)
    problems.raise_any()


# --- keys mergekit would silently ignore, and method names it does not know -----


class DuplicateKey(yaml.constructor.ConstructorError):
    """A key written twice in one YAML mapping."""


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML as mergekit reads it (safe_load), except that a key written twice
    in one mapping is an error: safe_load keeps the last without a word, so
    the first value would be shown in the card but never used."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(
                ":merge"
            ):
                continue  # `<<: *alias` may override keys; those are not repeats
            key = self.construct_object(key_node)
            if key in seen:
                raise DuplicateKey(
                    None,
                    None,
                    f"the key {key!r} is written twice in one mapping (first at "
                    f"line {seen[key].line + 1}); YAML keeps only the last, so "
                    "the first value would be shown but never used. Write it once",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def written_document(text: str) -> Any:
    """The configuration's YAML as written, keys checked for repeats
    (DuplicateKey); any other YAML error is the caller's to report."""
    loader = UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def key_problems(document: Any, method: str) -> list[str]:
    """Every key of a configuration's YAML that mergekit's schema does not
    read (pydantic drops it without a word): a typo, or a setting in the
    wrong place. `method` names ours in the messages."""

    specs = {
        s.name for m in METHODS if m.spec.name == method for s in m.spec.parameters
    }
    return list(_unknown_keys(document, MergeConfiguration, "", specs))


def _unknown_keys(
    value: Any, schema: type[BaseModel], where: str, parameters: set[str]
) -> Iterator[str]:
    if not isinstance(value, dict):
        return
    fields = schema.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    for key, item in value.items():
        label = f"{where}.{key}" if where else str(key)
        if key not in known:
            yield _unknown_key(label, str(key), known, parameters, where)
            continue
        if key == "parameters":
            continue  # each parameter is checked against the method's spec
        inner = _schema_of(fields[key].annotation)
        if inner is None:
            continue
        kind, model = inner
        if kind == "list" and isinstance(item, list):
            for index, element in enumerate(item):
                yield from _unknown_keys(
                    element, model, f"{label}[{index}]", parameters
                )
        elif kind == "dict" and isinstance(item, dict):
            for name, element in item.items():
                yield from _unknown_keys(element, model, f"{label}.{name}", parameters)
        elif kind == "one":
            yield from _unknown_keys(item, model, label, parameters)


def _schema_of(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """The one nested section model an annotation holds, and how: 'one',
    'list' or 'dict' (None: a plain value, a model reference, a union)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _schema_of(inner[0]) if len(inner) == 1 else None
    if origin in (list, tuple):
        found = _schema_of(typing.get_args(annotation)[0])
        return ("list", found[1]) if found and found[0] == "one" else None
    if origin is dict:
        found = _schema_of(typing.get_args(annotation)[1])
        return ("dict", found[1]) if found and found[0] == "one" else None
    plain = (ModelReference, ConditionalParameter)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return None if issubclass(annotation, plain) else ("one", annotation)
    return None


def _unknown_key(
    label: str, key: str, known: set[str], parameters: set[str], where: str
) -> str:
    ignored = f"{label}: mergekit does not read '{key}' here and would ignore it"
    if key in parameters and "parameters" in known:
        place = f"{where}.parameters" if where else "parameters"
        return f"{ignored}. It is a merge parameter: write it under {place}."
    close = _closest(key, known)
    hint = f"Did you mean '{close}'?" if close else "Remove it."
    return f"{ignored}. {hint} Keys read here: {', '.join(sorted(known))}."


def _closest(name: str, choices: typing.Iterable[str]) -> str | None:
    """The choice `name` most likely means: the same letters in another case
    or with `+`/`_`/`-` written differently, else the closest spelling."""
    folded = {_fold(choice): choice for choice in choices}
    if _fold(name) in folded:
        return folded[_fold(name)]
    close = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.7)
    return folded[close[0]] if close else None


def _fold(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower().replace("+", "plus"))


def _known_methods() -> list[str]:
    return sorted(m.spec.name for m in registry.registered_methods())


def method_problem(method: Any) -> str | None:
    """Why mergekit would fail on `merge_method` (None: it knows the method).

    mergekit looks the name up only while planning and stops with a
    traceback; a name close to one it knows gets a suggestion."""
    known = _known_methods()
    if method in known:
        return None
    close = _closest(str(method), known)
    ours = ", ".join(m.spec.name for m in METHODS)
    hint = f"Did you mean '{close}'?" if close else f"RAM and RAM+ are {ours}."
    return (
        f"merge_method: {method!r} is not a merge method mergekit knows. {hint} "
        f"Methods: {', '.join(known)}."
    )
