"""Put our methods into mergekit: every change to it is one line of `install`.

mergekit 0.1.5 has no plugin discovery and no hooks for what RAM+ needs, so
this writes into its registry table (taking over `ram` on purpose: stock
`ram` ignores r/alpha, ours equals it at defaults) and wraps two planner
methods, the card generator and its hub lookup, and run_merge (checks
first, a merge that touches only its own files). Each change names the hook
mergekit lacks that would remove it. Every step is idempotent and checks
that the host still looks as expected, failing with IncompatibleMergekit
otherwise rather than half-working.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import _mergekit_ram_autoload as autoload

SUPPORTED = "mergekit>=0.1.5,<0.2"
# What the card adds for a merge run (a MergeRun → its Markdown section).
CardSection = Callable[[Any], str]


class IncompatibleMergekit(RuntimeError):
    """The installed mergekit does not look like the one this plugin targets."""


def _incompatible(what: str) -> IncompatibleMergekit:
    return IncompatibleMergekit(
        f"mergekit-ram cannot install into this mergekit: {what}. It supports "
        f"{SUPPORTED}; install a supported mergekit or a mergekit-ram release "
        "made for yours."
    )


def _patch(owner: Any, name: str, what: str, wrap: Callable) -> None:
    """Replace `owner.name` by `wrap(owner.name)`, marked as ours (a no-op
    when it already is); refuses a missing one."""
    current = getattr(owner, name, None)
    if not callable(current):
        raise _incompatible(f"{what} is missing")
    if not hasattr(current, "__mergekit_ram__"):
        patched = wrap(current)
        patched.__mergekit_ram__ = current
        setattr(owner, name, patched)


def register_methods() -> None:
    """Register `ram` and `ramplus`, taking a name only from nobody, from
    stock `ram`, or from ourselves; a no-op when done."""
    from mergekit.merge_methods import ram as stock_ram
    from mergekit.merge_methods import registry

    from mergekit_ram.integration.methods import METHODS, RAMMerge

    table = getattr(registry, "_METHODS", None)
    if not isinstance(table, dict) or not callable(getattr(registry, "get", None)):
        raise _incompatible("mergekit.merge_methods.registry has no _METHODS table")
    for method in METHODS:
        current = table.get(method.spec.name)
        if not (
            current is None
            or isinstance(current, RAMMerge)
            or (method.spec.name == "ram" and current is stock_ram.ram_merge)
        ):
            raise _incompatible(
                f"merge method {method.spec.name!r} is already registered by "
                f"{type(current).__module__}"
            )
        table[method.spec.name] = method


def patch_planner(plan: ModuleType) -> None:
    """Wrap MergePlanner._plan / plan_to_disk for whole-model statistics."""
    from mergekit_ram.integration.statistics import patched_plan, patched_plan_to_disk

    planner = getattr(plan, "MergePlanner", None)
    for name, wrap in (("_plan", patched_plan), ("plan_to_disk", patched_plan_to_disk)):
        _patch(planner, name, f"MergePlanner.{name}", wrap)


def patch_card(merge: ModuleType, card_section: CardSection) -> None:
    """Add `card_section` to mergekit's model card; for a RAM merge, name its
    variant and the base model's licence and list its models in the
    configuration's order; and keep the card's hub lookup from failing or
    stalling a finished RAM merge offline."""
    from mergekit_ram.integration.card import described_card, in_config_order
    from mergekit_ram.integration.context import current_run
    from mergekit_ram.integration.methods import is_ours

    def local_is_hf(lookup: Callable) -> Callable:
        def is_hf(path: str) -> bool:
            # mergekit asks the hub whether a local folder named like a hub
            # id (`in/base`) is also a repository, to link it: offline that
            # fails after the whole merge, a silent hub stalls it. For a RAM
            # merge a path that exists here is the folder the merge read.
            if current_run() is not None and os.path.exists(path):
                return False
            return lookup(path)  # other methods keep mergekit's behaviour

        return is_hf

    def described(original: Callable) -> Callable:
        def generate_card(config, config_yaml, name=None):
            ours = is_ours(config.merge_method)
            run = current_run()
            if run is not None and run.card_name is not None:
                name = run.card_name  # OUT's name, not our staging folder's
            if ours:
                config = in_config_order(config)
            card = original(config=config, config_yaml=config_yaml, name=name)
            if ours:
                values = run.values if run is not None else {}
                card = described_card(card, config, values)
            return card if run is None else card + card_section(run)

        return generate_card

    original = getattr(merge, "generate_card", None)
    _patch(merge, "generate_card", "mergekit.merge.generate_card", described)
    if not hasattr(original, "__mergekit_ram__"):  # mergekit.card's, patched now
        card = sys.modules[original.__module__]
        _patch(card, "is_hf", "mergekit.card.is_hf", local_is_hf)


def patch_run_merge(merge: ModuleType) -> None:
    """Make mergekit's run_merge check and publish RAM merges (`publishing`).

    mergekit's scripts bind `run_merge` when they are imported. The autoload
    hook patches mergekit.merge before any of them can, and a script imported
    earlier (with the hook off) is rebound here.
    """
    from mergekit_ram.integration.publishing import guarded_run_merge

    original = getattr(merge, "run_merge", None)
    _patch(merge, "run_merge", "mergekit.merge.run_merge", guarded_run_merge)
    for name, module in list(sys.modules.items()):
        bound = getattr(module, "__dict__", {}).get("run_merge")
        if name.startswith("mergekit.") and bound is original:
            module.run_merge = merge.run_merge


def install(eager: bool, card_section: CardSection) -> None:
    """Register the methods and patch what of mergekit is loaded.

    With eager=False (called while mergekit is still importing) a module that
    is not completely loaded yet is left for the autoload hook to patch when
    its import finishes. `card_section`: what the card adds for a merge run.
    """
    # Every change to mergekit 0.1.5, each under the hook whose arrival would
    # let it go. (Besides these, `methods.RAMMerge` overrides
    # GroupMergeMethod._execute to hand the output dtype to the kernel.)
    patches: tuple[tuple[str, Callable[[ModuleType], None]], ...] = (
        # A way to replace a registered method (register() refuses a taken
        # name): registry._METHODS gets our `ram` and `ramplus`. Always first:
        # the methods exist before any plan.
        ("mergekit.merge_methods.registry", lambda _module: register_methods()),
        # A method hook after planning, and one for tasks after the model is
        # written: MergePlanner._plan makes merge tasks RAMMergeTask with
        # global λ; plan_to_disk adds a task writing ram_statistics.json.
        ("mergekit.plan", patch_planner),
        # A method hook for its card section, a card that knows local paths:
        # merge.generate_card and card.is_hf.
        ("mergekit.merge", lambda merge: patch_card(merge, card_section)),
        # A pre-merge validation hook and an output writer that stages and
        # publishes: merge.run_merge (and scripts that bound it).
        ("mergekit.merge", patch_run_merge),
    )
    for index, (module, apply) in enumerate(patches):
        loaded = module in sys.modules and module not in autoload.LOADING
        if loaded or eager or index == 0:
            # sys.modules first: a module whose import just finished is not yet
            # an attribute of its package, and `import a.b` would fail on it.
            apply(sys.modules.get(module) or importlib.import_module(module))
