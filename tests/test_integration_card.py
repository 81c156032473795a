"""mergekit_ram.integration.card, with the statistics document: strict JSON
(issue finding 10), the model card's model order, also in its RAM+ section
(issue 18), and its variant heading and licence (issue 30). The section's
own content is tests/test_analysis_card.py's."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import yaml
from huggingface_hub import ModelCard
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ram
from mergekit_ram.integration import card as results
from mergekit_ram.integration.card import base_license, variant
from mergekit_ram.integration.statistics import strict_json


def test_report_json_is_strict():
    document = {"a": [float("inf"), 1.5], "b": {"c": float("nan")}, "d": "x"}
    text = json.dumps(strict_json(document), allow_nan=False)
    assert json.loads(text) == {"a": [None, 1.5], "b": {"c": None}, "d": "x"}
    assert math.isfinite(strict_json(2.0))


def models_merged(card: str) -> list[str]:
    section = card.split("### Models Merged", 1)[1].split("###", 1)[0]
    return [line[2:] for line in section.splitlines() if line.startswith("* ")]


def statistics_rows(card: str, paths: list[str]) -> list[str]:
    section = card.split("### RAM+ statistics", 1)[1]
    cells = [line.split(" | ")[0].removeprefix("| ") for line in section.splitlines()]
    return [cell for cell in cells if cell in paths]


def base_with_card(family, tmp_path, card: str | None):
    """A copy of the family's base, with this README.md (none for None)."""
    base = tmp_path / "base"
    shutil.copytree(family.base, base)
    if card is not None:
        (base / "README.md").write_text(card, encoding="utf-8")
    return str(base)


@pytest.mark.parametrize(
    "order", [("gamma", "alpha", "beta"), ("beta", "alpha", "gamma")]
)
def test_card_order_heading_and_licence(order, family_f32, tmp_path):
    """The models in the configuration's order (mergekit lists a set, whose
    order changes with each process's hash seed: one order of the same
    models and its reverse, which no set order matches both of), the variant
    in the Merge Method heading and the base model's licence in the card's
    metadata."""
    family, out = family_f32, tmp_path / "out"
    licensed = "---\nlicense: apache-2.0\ntags: [x]\n---\n# Base\n"
    base = base_with_card(family, tmp_path, licensed)
    config = family.config_dict("ramplus", tasks=order, base_model=base)
    config = MergeConfiguration.model_validate(config)
    mergekit_ram.run_merge(config, str(out), MergeOptions(quiet=True))
    card = (out / "README.md").read_text(encoding="utf-8")
    paths = [family.paths[name] for name in order]
    assert models_merged(card) == paths
    assert statistics_rows(card, paths) == paths
    assert f"### Merge Method: {GLOBAL}" in card.splitlines()
    metadata = yaml.safe_load(card.split("---\n")[1])
    assert metadata["license"] == "apache-2.0"
    assert metadata["tags"] == ["mergekit", "merge"]  # mergekit's, as it wrote them
    assert ModelCard(card).data.license == "apache-2.0"


GLOBAL = "RAM+ (global statistics, clip rule, `shared: mean`)"
LOCAL = "RAM+ (tensor-local statistics, soft rule, `shared: mean`)"
MIXED = [{"filter": "mlp", "value": "ties"}, {"value": "mean"}]
VARIANTS = [("ramplus", {}, GLOBAL), ("ram", {"r": 0.1}, GLOBAL)]
VARIANTS += [("ramplus", {"statistics": "tensor", "saturation": "soft"}, LOCAL)]
VARIANTS += [("ram", {"shared": m}, f"RAM (`shared: {m}`)") for m in ("ties", "base")]
VARIANTS += [("ram", {"shared": MIXED}, "RAM (shared varies per tensor)")]


@pytest.mark.parametrize(("method", "parameters", "name"), VARIANTS)
def test_variant_names_what_the_configuration_merges_with(
    method, parameters, name, family_f32
):
    """The heading names what the plan resolved, per tensor."""
    from mergekit_ram.integration.statistics import plan_merges
    from mergekit_ram.integration.validation import resolved_values

    config = family_f32.config_dict(method, parameters=parameters or None)
    merges = plan_merges(MergeConfiguration.model_validate(config), MergeOptions())
    assert variant(resolved_values(merges)) == name


# None; no front matter; none stated; a list; not YAML; not a mapping.
NO_LICENCE = [None, "# No front matter\nlicense: mit\n", "---\ntags: [x]\n---\n"]
NO_LICENCE += ["---\nlicense: [a, b]\n---\n", "---\nlicense: [unclosed\n---\n"]
NO_LICENCE += ["---\n- license\n---\n"]


@pytest.mark.parametrize("card", NO_LICENCE)
def test_no_licence_where_the_base_card_states_none(card, family_f32, tmp_path):
    base = base_with_card(family_f32, tmp_path, card)
    config = family_f32.config_dict("ramplus", base_model=base)
    assert base_license(MergeConfiguration.model_validate(config)) is None


@pytest.mark.parametrize("cached", ["llama3.2", "refused"])
def test_licence_of_a_hub_base_from_the_local_cache(cached, monkeypatch, tmp_path):
    """A hub id's licence is read from the local cache (no download); an id
    the cache refuses has none."""
    from huggingface_hub.errors import HFValidationError

    readme = tmp_path / "README.md"
    readme.write_text(f"---\nlicense: {cached}\n---\n", encoding="utf-8")
    asked = []

    def lookup(repo, filename, revision=None):
        asked.append((repo, filename, revision))
        if cached == "refused":
            raise HFValidationError(f"bad repo id {repo}")
        return str(readme)

    monkeypatch.setattr(results.huggingface_hub, "try_to_load_from_cache", lookup)
    config = dict(
        merge_method="ram", base_model="org/base@v1", models=[{"model": "a/b"}]
    )
    config = MergeConfiguration.model_validate(config)
    assert base_license(config) == (None if cached == "refused" else cached)
    assert asked == [("org/base", "README.md", "v1")]


MERGEKIT_CARD = (
    "---\nbase_model: []\nlibrary_name: transformers\ntags:\n- mergekit\n- merge\n"
    "\n---\n# Merged\n\n### Merge Method\n\nRAM.\n"
)
LICENSED = MERGEKIT_CARD.replace("- merge\n\n---", "- merge\nlicense: mit\n---")
OTHER = "---\nlicense: other\n---\n# A\n"


# The licence closes the metadata, the rest of mergekit's card as it was; none
# to add: not re-serialised.
DESCRIBED = [("mit", MERGEKIT_CARD, LICENSED), (None, MERGEKIT_CARD, MERGEKIT_CARD)]


@pytest.mark.parametrize(
    ("licence", "card", "expected"), [*DESCRIBED, ("mit", OTHER, OTHER)]
)
def test_described_card_adds_a_licence_only_where_the_card_has_none(
    licence, card, expected, monkeypatch
):
    monkeypatch.setattr(results, "base_license", lambda _config: licence)
    described = results.described_card(card, None, {"r": {0.0}, "shared": {"mean"}})
    heading = "### Merge Method: RAM (`shared: mean`)\n"
    assert described == expected.replace("### Merge Method\n", heading)
