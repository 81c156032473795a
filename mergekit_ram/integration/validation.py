"""Checks of a `ram` / `ramplus` merge, each rule in one place, before any
weight is read.

Before mergekit plans (`check_config`): the method name, every key of the
YAML, each value through the method's own pydantic spec, which models are
merged, their folders and their checkpoints' headers. Once mergekit has
planned (`check_plan`, called by the planner hook): one value per setting
under global statistics, one unique_scale per model, alpha only with the clip
rule, density only with `shared: ties`, λ within the output dtype.

The rule for keys (docs/errors.md): a key meant for RAM (one of our parameter
names or a near miss of one, wherever it stands, or a misspelled
`parameters:`) is an error; a key RAM ignores, as stock mergekit ignores it,
is a warning line and the merge runs as stock would.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import suppress
from functools import partial
from typing import Any

import yaml
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from mergekit.architecture import arch_info_for_config
from mergekit.common import ModelReference, dtype_from_name
from mergekit.config import MergeConfiguration
from mergekit.merge_methods import registry
from mergekit.merge_methods.base import ParameterScope
from mergekit.options import MergeOptions
from pydantic import ValidationError

from mergekit_ram.core.errors import Problems, RAMInputError
from mergekit_ram.core.rule import MergeSettings, unique_scale_error
from mergekit_ram.integration.checkpoints import WEIGHT_FILES, check_models
from mergekit_ram.integration.errors import UnknownMethod
from mergekit_ram.integration.methods import METHODS, RAMMerge, is_ours

RESCALE_FACTOR_HINT = (
    "The authors' --rescale_factor R is r = R − 1 here: their arm-r-v2 is "
    "r: R − 1 with alpha: 1, their arm-r is r: R − 1 with saturation: soft "
    "(R = 1.2 is r: 0.2)."
)


class Findings(Problems):
    """A configuration's problems and warnings, and where the user wrote
    each of our parameters (`written`: key → its first place), for the
    plan-time rules about settings that act only beside another."""

    def __init__(self) -> None:
        super().__init__("The configuration")
        self.written: dict[str, str] = {}


# --- before planning ----------------------------------------------------------


def check_config(
    config: MergeConfiguration,
    options: MergeOptions | None = None,
    document: Any = None,
    user: str | None = None,
) -> Findings:
    """Refuse what the user must fix in a RAM merge (or, with `user` set, in
    what `mergekit-ram analyze` measures, for any method: then the keys and
    parameters are checked only for ours); returns the warnings for
    `check_plan`. A method mergekit does not know raises UnknownMethod (a
    RuntimeError, as mergekit raises) listing every problem of the file.

    `document` is the YAML as written (mergekit drops keys it does not read);
    without it the configuration's own fields are checked.
    """
    findings = Findings()
    method = _method(config.merge_method, findings)
    if is_ours(method):
        # What pydantic read, every field present: a written key missing here
        # is one mergekit drops. (Python mode: mergekit 0.1.5 cannot serialize
        # a model path holding a space or a quote to JSON.)
        read = config.model_dump()
        document = read if document is None else document
        ours = next(m for m in METHODS if m.spec.name == method)
        base = document.get("base_model") if isinstance(document, dict) else None
        _keys(document, read, "", ours, base, findings)
    elif user is None and not findings.found:
        return findings  # another method's merge: mergekit's to check
    user = user or f"merge_method {method}"
    with findings.check():
        _check_models(config, options, user, findings)
    if findings.found:
        error = findings.error()
        raise UnknownMethod(error.message) if method != config.merge_method else error
    return findings


def _method(name: Any, findings: Findings) -> str:
    """A misspelling of ours is checked as the method it means, so it is
    reported with every other problem; any other unknown name alone."""
    known = sorted(m.spec.name for m in registry.registered_methods())
    if name in known:
        return name
    close = _closest(str(name), known)
    hint = f"Did you mean '{close}'?" if close else "RAM and RAM+ are ram, ramplus."
    message = (
        f"merge_method: {name!r} is not a merge method mergekit knows. {hint} "
        f"Methods: {', '.join(known)}."
    )
    if not is_ours(close):
        raise UnknownMethod(message)
    findings.add(message)
    return close


def _check_models(
    config: MergeConfiguration,
    options: MergeOptions | None,
    user: str,
    findings: Findings,
) -> None:
    """Base and task models, their folders, then (all else right) headers."""
    lists = list(model_lists(config))
    bases = [("base_model", config.base_model)]
    bases += [(label, base) for label, _, base in lists if base is not None]
    if not bases[0][1] and len(bases) == 1:
        raise RAMInputError(
            f"{user} needs a base_model: the model the task models were "
            "fine-tuned from, which every task vector is measured against. Add "
            "'base_model: path/to/base' to the configuration."
        )
    base = next(reference for _, reference in bases if reference is not None)
    for label, other in bases[1:]:
        if other != base:
            findings.add(
                f"{label}: its base model {other} differs from {base}, the "
                f"base_model. {user} measures every task vector against one base "
                "model, the one the task models were fine-tuned from: remove "
                "that slice's base_model, or make it the same."
            )
    for label, entries, _ in lists:
        with findings.check():
            _check_list(label, entries, base)
    if all(m == base for _, entries, _ in lists for m in entries):
        findings.add(
            f"{user} needs at least one task model besides the base model "
            f"{base}: list the fine-tuned models to merge."
        )
    roles = [("base_model", base)] + [
        (f"{_item(label, i)}.model", m)
        for label, e, _ in lists
        for i, m in enumerate(e)
    ]
    tokenizer = config.tokenizer.source if config.tokenizer else None
    for role, source in (
        ("tokenizer_source", config.tokenizer_source),
        ("tokenizer", tokenizer),
    ):
        if isinstance(source, ModelReference):
            roles.append((role, source))
    seen: set[ModelReference] = set()
    for role, reference in roles:
        if reference not in seen:
            seen.add(reference)
            with findings.check():
                check_location(reference.model.path, role, model="model" in role)
                if reference.lora is not None:
                    check_location(reference.lora.path, f"{role} (LoRA)")
    for key in ("dtype", "out_dtype"):
        with findings.check():
            _check_dtype(key, getattr(config, key))
    if findings.found:
        return
    free = bool(config.tokenizer_source or config.tokenizer)
    free = free or bool(options and options.unsafe_truncate_embeddings)
    for label, entries, _ in lists:
        check_models(
            ("base_model", base.model.path) if local(base) else None,
            [
                (f"{_item(label, i)}.model", m.model.path)
                for i, m in enumerate(entries)
                if m != base and local(m)
            ],
            compare=not label.endswith("]"),
            vocabulary_free=free,
            cast=config.dtype is not None,
            read=partial(architecture_names, base, options),
        )


def model_lists(
    config: MergeConfiguration,
) -> Iterator[tuple[str, list[ModelReference], ModelReference | None]]:
    """Each list of models merged together, in the configuration's order:
    (its label, its models, a slice's own base_model or None)."""
    sections = [("", config)] + [
        (f"modules.{name}.", module) for name, module in (config.modules or {}).items()
    ]
    for prefix, section in sections:
        if section.models:
            yield f"{prefix}models", [entry.model for entry in section.models], None
        for index, output in enumerate(section.slices or ()):
            sources = [source.model for source in output.sources]
            yield f"{prefix}slices[{index}]", sources, output.base_model


def _item(label: str, index: int) -> str:
    """How the YAML spells a list's entry: models[1], slices[0].sources[1]."""
    return f"{label}.sources[{index}]" if label.endswith("]") else f"{label}[{index}]"


def _check_list(label: str, models: list[ModelReference], base: ModelReference) -> None:
    """Each model once (a revision or a LoRA makes another model), and a
    slice lists its base."""
    if label.endswith("]") and base not in models:
        raise RAMInputError(
            f"{label}: the base model {base} is not among "
            "its sources, and mergekit needs it there for a slice: add it as a "
            "source with the same layer_range as the others."
        )
    for index, model in enumerate(models):
        if model in models[:index]:
            raise RAMInputError(
                f"{_item(label, index)}: model {model} is already listed as "
                f"{_item(label, models.index(model))}. List each model once (the "
                "base model may appear once among the models)."
            )


def _check_dtype(key: str, name: str | None) -> None:
    """RAM computes task vectors in floating point."""
    try:
        if name is None or dtype_from_name(name).is_floating_point:
            return
        problem = "is not a floating-point dtype"
    except RuntimeError as error:
        problem = f"is not a dtype mergekit knows ({error})"
    raise RAMInputError(
        f"{key}: {name!r} {problem}. RAM computes task vectors in floating "
        "point: write one of bfloat16, float16, float32, float64."
    )


# --- model folders ------------------------------------------------------------


def local(reference: ModelReference) -> bool:
    """A model (no LoRA) in a local folder: its headers can be read here."""
    return reference.lora is None and os.path.isdir(reference.model.path)


def check_location(path: str, role: str, *, model: bool = False) -> None:
    """A local folder (with weights and config.json, for a `model`), or a
    name mergekit would look up on the hub."""
    if os.path.isdir(path):
        if model:
            _check_model_folder(path, role)
        return
    if os.path.exists(path):
        raise RAMInputError(
            f"{role}: {path} is a file; mergekit needs the model's directory "
            "(config.json and its weights)."
        )
    with suppress(HFValidationError):
        return validate_repo_id(path)  # a hub id: mergekit downloads it
    relative = (
        ""
        if os.path.isabs(path)
        else f" (relative paths start from the current directory, {os.getcwd()})"
    )
    raise RAMInputError(
        f"{role}: {path} does not exist{relative}. Fix the path, or create the model "
        "there first."
    )


def _check_model_folder(path: str, role: str) -> None:
    names = set(os.listdir(path))
    if not names.intersection(WEIGHT_FILES):
        adapter = (
            f" It holds a LoRA adapter: write the model as BASE+{path}."
            if "adapter_config.json" in names
            else ""
        )
        raise RAMInputError(
            f"{role}: {path} has no weights mergekit can load; it looks for "
            f"{', '.join(WEIGHT_FILES)}. Point {role} at the directory "
            f"save_pretrained wrote the model to.{adapter}"
        )
    if "config.json" not in names:
        raise RAMInputError(
            f"{role}: {path} has no config.json, which mergekit reads the "
            "architecture from. Copy it from the model this one was "
            "fine-tuned from, or save the model with save_pretrained."
        )


def architecture_names(
    reference: ModelReference, options: MergeOptions | None
) -> frozenset[str] | None:
    """The tensor names mergekit reads from a model of the base's architecture
    (aliases and tied names included); None where mergekit has no definition
    of it (it then infers one from the files: every tensor may be read)."""
    trust = options is not None and options.trust_remote_code
    try:
        config = reference.config(trust_remote_code=trust)
        architecture = arch_info_for_config(config)
        weights = [] if architecture is None else architecture.all_weights(config)
    except (OSError, ValueError, RuntimeError, KeyError, AttributeError):
        return None  # mergekit reports these itself when it plans
    names = set()
    for weight in weights:
        names.update((weight.name, *(weight.aliases or ()), *(weight.tied_names or ())))
    return frozenset(names) or None


# --- keys and values ------------------------------------------------------------


def _keys(
    value: Any, read: Any, where: str, method: RAMMerge, base: Any, findings: Findings
) -> None:
    """The written document against what mergekit read from it (`read`, every
    field of the section present): a written key `read` lacks is dropped."""
    if not isinstance(value, dict) or not isinstance(read, dict):
        return
    base = value.get("base_model", base)
    for key, item in value.items():
        label = f"{where}.{key}" if where else str(key)
        if key not in read:
            _unread_key(label, str(key), set(read), where, method, findings)
        elif key == "parameters" and isinstance(item, dict):
            model = value.get("model") if "model" in read else None
            _parameters(item, label, model, model == base, method, findings)
        elif isinstance(item, list) and isinstance(read[key], list):
            for index, (element, inner) in enumerate(zip(item, read[key])):
                _keys(element, inner, f"{label}[{index}]", method, base, findings)
        else:
            _keys(item, read[key], label, method, base, findings)


def _unread_key(
    label: str,
    key: str,
    known: set[str],
    where: str,
    method: RAMMerge,
    findings: Findings,
) -> None:
    """A key mergekit's schema does not read here (pydantic drops it)."""
    ours = [spec.name for spec in method.spec.parameters]
    meant = key if key in ours else _closest(key, ours)
    ignored = f"{label}: mergekit does not read '{key}' here and"
    if "parameters" in known and meant and (meant == key or key not in _others()):
        place = f"{where}.parameters" if where else "parameters"
        spelled = "" if meant == key else f" (did you mean '{meant}'?)"
        findings.add(
            f"{ignored} would ignore it. It is a {method.spec.name} parameter"
            f"{spelled}: write it under {place}."
        )
    elif "parameters" in known and _closest(key, ["parameters"]):
        findings.add(f"{ignored} would ignore it. Did you mean 'parameters'?")
    else:
        close = _closest(key, known)
        findings.warn(
            f"{ignored} ignores it" + (f"; did you mean '{close}'?" if close else ".")
        )


def _parameters(
    block: dict,
    label: str,
    model: Any,
    on_base: bool,
    method: RAMMerge,
    findings: Findings,
) -> None:
    """One `parameters:` mapping: our keys in their place with valid values
    (pydantic's message for a bad one), any other key by `_other_key`."""
    specs = {spec.name: spec for spec in method.spec.parameters}
    for key, setting in block.items():
        where = f"{label}.{key}" + ("" if model is None else f" (model {model})")
        spec = specs.get(key)
        if spec is None:
            _other_key(where, str(key), method, findings)
            continue
        if model is not None and spec.scope == ParameterScope.SHARED:
            if key in _others(per_model=True):
                _other_key(where, str(key), method, findings)  # e.g. TIES' density
            else:
                findings.add(
                    f"{where}: '{key}' applies to the whole merge, and mergekit "
                    "ignores it under one model. Move it to the top-level "
                    "parameters."
                )
            continue
        findings.written.setdefault(key, where)
        if on_base and spec.scope == ParameterScope.NON_BASE:
            findings.add(
                f"{where}: the base model has no task vector to scale, and "
                f"mergekit ignores {key} on it. Remove it, or set it on a task model."
            )
        for value in _leaves(setting):
            try:
                spec.validate(value)
            except ValidationError as error:
                findings.add(f"{where}: {error.errors()[0]['msg']} (got {value!r}).")


def _other_key(where: str, key: str, method: RAMMerge, findings: Findings) -> None:
    """A parameter name that is not ours: a near miss of ours is an error,
    another method's parameter or an unknown name a warning."""
    ours = [spec.name for spec in method.spec.parameters]
    others = _others().get(key)
    meant = _closest(key, ours)
    if others and len(others) > 3:
        others = [*others[:2], f"and {len(others) - 2} others"]
    if key == "rescale_factor":
        findings.add(
            f"{where}: {method.spec.name} has no parameter '{key}'. "
            f"{RESCALE_FACTOR_HINT}"
        )
    elif others:
        findings.warn(
            f"{where}: {method.spec.name} does not use '{key}' here (a parameter "
            f"of {', '.join(others)}); it is ignored, as stock mergekit ignores it."
        )
    elif meant:
        findings.add(
            f"{where}: {method.spec.name} has no parameter '{key}'. Did you "
            f"mean '{meant}'? Its parameters: {', '.join(ours)}."
        )
    else:
        close = _closest(key, _others())
        hint = f"; did you mean '{close}'?" if close else "."
        findings.warn(
            f"{where}: no mergekit method has a parameter '{key}', so it is "
            f"ignored{hint}"
        )


def _others(per_model: bool = False) -> dict[str, list[str]]:
    """Each parameter name of a method that is not ours → those methods
    (`per_model`: only where the method reads it per model)."""
    names: dict[str, list[str]] = {}
    for method in registry.registered_methods():
        if not is_ours(method.spec.name):
            for spec in method.spec.parameters:
                if not per_model or spec.scope != ParameterScope.SHARED:
                    names.setdefault(spec.name, []).append(method.spec.name)
    return names


def _leaves(setting: Any) -> Iterator[Any]:
    """The scalar values a written setting holds (inside filters and
    gradients)."""
    if isinstance(setting, dict):
        yield from _leaves(setting.get("value"))
    elif isinstance(setting, list):
        for item in setting:
            yield from _leaves(item)
    else:
        yield setting


def _closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice `name` most likely means: the same letters in another case
    or with `+`/`_`/`-` written differently, else the closest spelling."""
    folded = {_fold(choice): choice for choice in choices}
    if _fold(name) in folded:
        return folded[_fold(name)]
    close = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.7)
    return folded[close[0]] if close else None


def _fold(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower().replace("+", "plus"))


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


# --- on mergekit's plan ------------------------------------------------------------

# Settings that act only beside another one's value: (key, partner, value,
# what it does, whether setting it alone is an error). `density` is also other
# methods' parameter, so stock mergekit users write it: a warning.
ONLY_WITH = (
    ("density", "shared", "ties", "TIES on the shared elements", False),
    ("alpha", "saturation", "clip", "the clip rule's cap on S/U", True),
)


def resolved_values(merges: Iterable[Any]) -> dict[str, set[Any]]:
    """Every value each shared parameter takes over the planned merge tasks."""
    values: dict[str, set[Any]] = {}
    for task in merges:
        for key, value in task.parameters.items():
            values.setdefault(key, set()).add(value)
    return values


def check_plan(
    merges: list[Any], findings: Findings | None = None
) -> tuple[MergeSettings, dict[Any, float | None]]:
    """The rules on mergekit's resolved parameters, with the configuration's
    earlier warnings: every error in one block, else each warning logged.
    Returns the merge's settings and each task model's explicit unique_scale."""
    findings = findings or Findings()
    result = None
    with findings.check():
        result = planned_settings(merges, findings.written)
    values = resolved_values(merges)
    for key, partner, value, what, refused in ONLY_WITH:
        if key in findings.written and value not in values.get(partner, ()):
            message = (
                f"{findings.written[key]}: {key} only applies with {partner}: "
                f"{value} ({what}), and this merge never uses it, so it "
                f"{'would be' if refused else 'is'} ignored. Add '{partner}: "
                f"{value}' next to it, or remove {key}."
            )
            findings.add(message) if refused else findings.warn(message)
    if values.get("r") == {0.0}:
        for key in ("alpha", "saturation", "statistics"):
            if key in findings.written:
                findings.warn(
                    f"{findings.written[key]}: with r = 0 every λ is 1 (plain "
                    f"RAM), so {key} has no effect and is ignored. Set r > 0 "
                    f"(RAM+) to use it, or remove {key}."
                )
    findings.raise_any()
    findings.emit()
    return result


def planned_settings(
    merges: list[Any], written: dict[str, str] | None = None
) -> tuple[MergeSettings, dict[Any, Any]]:
    """The merge's scalar settings and each task model's explicit
    `unique_scale`, which must be one value per model (`written`: where the
    user wrote each setting, for the message)."""
    settings = MergeSettings.from_parameters(
        ((task.output_weight.name, task.parameters) for task in merges), written
    )
    found: dict[Any, tuple] = {}
    for task in merges:
        for model, params in task.input_parameters.items():
            if model == merges[0].base_model:
                continue
            value = params.get("unique_scale")
            seen = found.setdefault(model, (value, task.output_weight.name))
            if seen[0] != value:
                raise unique_scale_error(
                    model,
                    f"is {seen[0]!r} for tensor {seen[1]} but {value!r} for "
                    f"{task.output_weight.name}",
                )
    return settings, {model: value for model, (value, _) in found.items()}
