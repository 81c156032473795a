"""The model card of a RAM merge: its variant in the Merge Method heading, the
base model's licence, its models in the configuration's order, and where
mergekit-ram comes from. (The RAM+ statistics section is `statistics`'.)"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import huggingface_hub
import yaml
from mergekit.common import ModelReference
from mergekit.config import MergeConfiguration

from mergekit_ram.integration.validation import model_lists


def where_from() -> str:
    """Where a reader of the card gets mergekit-ram (it is not on PyPI): the
    repository the installed package declares (pyproject's [project.urls])."""
    try:
        entries = metadata.metadata("mergekit-ram").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        entries = []
    urls = dict(entry.split(", ", 1) for entry in entries if ", " in entry)
    for key in ("Repository", "Source", "Homepage"):
        if key in urls:
            return f"not on PyPI: install it from its repository, {urls[key]}"
    return "not on PyPI: installed from a clone of its repository"


SHARED = ("mean", "ties", "base")  # the `shared` modes


def shared_mode(values: Mapping[str, set[Any]]) -> str | None:
    """The one `shared` mode a planned RAM merge uses (None: another method,
    or it varies per tensor), for the verdict's advice."""
    modes = values.get("shared", set())
    return next(iter(modes)) if len(modes) == 1 else None


def variant(values: Mapping[str, set[Any]]) -> str:
    """The RAM variant a planned merge uses (each setting's values over its
    tensors), for the card's heading: RAM or RAM+, the statistics scope and
    rule (RAM+), and `shared`."""

    def one(name: str, words: Mapping[Any, str]) -> str:
        if len(values[name]) == 1:
            return words[next(iter(values[name]))]
        return f"{name} varies per tensor"

    parts, name = [], "RAM"
    if any(r > 0 for r in values["r"]):
        name = "RAM+" if all(r > 0 for r in values["r"]) else "RAM / RAM+"
        scopes = {"global": "global statistics", "tensor": "tensor-local statistics"}
        rules = {"clip": "clip rule", "soft": "soft rule"}
        parts += [one("statistics", scopes), one("saturation", rules)]
    parts.append(one("shared", {mode: f"`shared: {mode}`" for mode in SHARED}))
    return f"{name} ({', '.join(parts)})"


def base_license(config: MergeConfiguration) -> str | None:
    """The licence the base model's card (README.md front matter) states:
    a local folder's, or a hub model's already in the local cache (no
    download). None when there is none to read."""
    if config.base_model is None:
        return None
    location = config.base_model.model
    readme = os.path.join(location.path, "README.md")
    try:
        if not os.path.isdir(location.path):
            cached = huggingface_hub.try_to_load_from_cache(
                location.path, "README.md", revision=location.revision
            )
            readme = cached if isinstance(cached, str) else ""
        metadata = huggingface_hub.metadata_load(readme) or {}
    except (OSError, ValueError, yaml.YAMLError):  # no file, bad id, not a mapping
        return None
    value = metadata.get("license")
    return value if isinstance(value, str) and value.strip() else None


def described_card(
    card: str, config: MergeConfiguration, values: Mapping[str, set[Any]]
) -> str:
    """mergekit's card for a RAM merge, with the variant in its Merge Method
    heading and the base model's licence in its metadata (mergekit writes
    neither). The card's own text is kept byte for byte when no licence is
    added."""
    heading = f"### Merge Method: {variant(values)}\n"
    card = card.replace("### Merge Method\n", heading, 1)
    if (license_ := base_license(config)) is None:
        return card
    model_card = huggingface_hub.ModelCard(card)
    if model_card.data.license is not None:
        return card
    model_card.data.license = license_
    return str(model_card)


class _InConfigOrder(MergeConfiguration):
    """A configuration whose referenced_models() follows the configuration."""

    def referenced_models(self) -> list[ModelReference]:
        position: dict[ModelReference, int] = {}
        for _, models, _ in model_lists(self):
            for reference in [self.base_model, *models]:
                position.setdefault(reference, len(position))
        found = super().referenced_models()
        return sorted(found, key=lambda m: position.get(m, len(position)))


def in_config_order(config: MergeConfiguration) -> MergeConfiguration:
    """`config` as mergekit's card should see it: the card lists
    referenced_models(), a set in mergekit, so its model list (and its
    `base_model` metadata) changed order from run to run."""
    return _InConfigOrder.model_construct(**dict(config))


def card_hooks(card_section: Any) -> tuple[Any, Any]:
    """Wrappers for mergekit's `generate_card` and `card.is_hf`, for a RAM merge
    (one is running: only our run_merge opens one): its variant, licence and
    models in the configuration's order, `card_section(run)` added, OUT's
    name, and no hub lookup for a folder it read. Outside one both are
    mergekit's own, arguments passed through untouched."""
    from mergekit_ram.integration.context import current_run
    from mergekit_ram.integration.host import bound

    def described(original: Any) -> Any:
        def generate_card(*args: Any, **kwargs: Any) -> str:
            if (run := current_run()) is None:
                return original(*args, **kwargs)
            call = bound(original, args, kwargs)
            given = call.arguments
            config = given["config"] = in_config_order(given["config"])
            given["name"] = run.card_name  # OUT's, not our staging folder's
            card = original(*call.args, **call.kwargs)
            return described_card(card, config, run.values) + card_section(run)

        return generate_card

    def local_is_hf(lookup: Any) -> Any:
        # mergekit asks the hub whether a local folder named like a hub id
        # (`in/base`) is also a repository, to link it: offline that fails
        # after the whole merge, a silent hub stalls it. For a RAM merge a
        # path that exists here is the folder the merge read.
        def is_hf(*args: Any, **kwargs: Any) -> bool:
            if current_run() is not None and args and os.path.exists(args[0]):
                return False
            return lookup(*args, **kwargs)

        return is_hf

    return described, local_is_hf
