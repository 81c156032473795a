"""Put our methods into mergekit, all or nothing; refuse them when that failed.

mergekit 0.1.5 has no plugin discovery and no hooks for what RAM+ needs. As
soon as `mergekit.merge_methods` is loaded, its `get` is routed (`_routed`):
`ram` and `ramplus` answer with ours once installed, and until then a lookup
installs first, so a host that changed refuses them with IncompatibleMergekit
instead of merging with stock `ram` or per-tensor λ. Every other name is
mergekit's own lookup, untouched. Installing (`_install`) probes the whole
contract (`host`), then wraps what it lists (undone if any step fails), and
registers `ramplus` last through mergekit's public `register`.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import _mergekit_ram_autoload as autoload
from mergekit_ram.integration.host import OURS, incompatible, probe

_installed: dict[str, Any] = {}  # our methods by name, once installed
# What install was given to add to the card (a MergeRun → its Markdown
# section), for an install that a lookup starts.
_section: list[Callable[[Any], str]] = []


def _patch(owner: Any, name: str, wrap: Callable, done: list) -> None:
    """Replace `owner.name` by `wrap(owner.name)`, marked as ours (a no-op
    when it already is), noted in `done` for undoing."""
    current = getattr(owner, name)
    if not hasattr(current, "__mergekit_ram__"):
        patched = functools.update_wrapper(wrap(current), current)
        patched.__mergekit_ram__ = current
        setattr(owner, name, patched)
        done.append((owner, name, current))


def _routed(original: Callable) -> Callable:
    """mergekit's method lookup, with our names answered by `_ours`."""

    def get(*args: Any, **kwargs: Any) -> Any:
        name = args[0] if args else kwargs.get("name")
        return _ours(name) if name in OURS else original(*args, **kwargs)

    return get


def _ours(name: str) -> Any:
    """Our method `name`, installing first (IncompatibleMergekit if not)."""
    if not _installed:
        install(eager=True, card_section=_section[0])
    return _installed[name]


def _install(card_section: Callable[[Any], str]) -> None:
    """Probe, wrap, register: the whole change to mergekit, or none of it."""
    probe()
    try:
        from mergekit import card, merge, merge_methods
        from mergekit.plan import MergePlanner

        from mergekit_ram.integration import statistics
        from mergekit_ram.integration.card import card_hooks
        from mergekit_ram.integration.methods import METHODS
        from mergekit_ram.integration.publishing import guarded_run_merge
    except ImportError as error:  # a published name of the host's moved
        if (error.name or "").split(".")[0] not in ("mergekit", "transformers"):
            raise  # ours: a bug keeps its traceback
        raise incompatible(str(error)) from error
    described, local_is_hf = card_hooks(card_section)
    done: list = []
    try:
        _patch(MergePlanner, "_plan", statistics.patched_plan, done)
        _patch(MergePlanner, "plan_to_disk", statistics.patched_plan_to_disk, done)
        _patch(card, "is_hf", local_is_hf, done)
        _patch(merge, "generate_card", described, done)
        original = merge.run_merge
        _patch(merge, "run_merge", guarded_run_merge, done)
        # mergekit's scripts bind run_merge when imported: one imported
        # before us (with the hook off) is rebound.
        for name, module in list(sys.modules.items()):
            bound = name.startswith("mergekit.") and vars(module).get("run_merge")
            if bound is original:
                _patch(module, "run_merge", lambda _: merge.run_merge, done)
        # Last: mergekit has no way to unregister. (The lookup is routed: a
        # `ramplus` another plugin registered is shadowed by ours.)
        if "ramplus" not in {m.spec.name for m in merge_methods.registered_methods()}:
            merge_methods.register(METHODS[1])
    except BaseException:
        for owner, name, value in reversed(done):
            setattr(owner, name, value)
        raise
    _installed.update({method.spec.name: method for method in METHODS})


def install(eager: bool, card_section: Callable[[Any], str]) -> None:
    """Route mergekit's method lookup, and install when mergekit can be
    imported whole: eagerly (our commands and API), or, from the autoload
    hook (eager=False), once mergekit.merge is loaded and no watched module
    is still importing. Otherwise the first lookup of ours installs."""
    _section[:] = [card_section]
    methods = "mergekit.merge_methods"
    if eager or (methods in sys.modules and methods not in autoload.LOADING):
        module = sys.modules.get(methods) or importlib.import_module(methods)
        if not callable(getattr(module, "get", None)):
            raise incompatible("mergekit.merge_methods.get is missing")
        _patch(module, "get", _routed, [])
    whole = not autoload.LOADING and "mergekit.merge" in sys.modules
    if not _installed and (eager or whole):
        _install(card_section)
