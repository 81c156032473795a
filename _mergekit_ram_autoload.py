"""Start-up hook that makes `merge_method: ram/ramplus` work in plain mergekit.

Run from mergekit_ram_autoload.pth at interpreter start, which passes in what
to call ("module:function"). Standard library only and nothing imported until
mergekit itself is: a meta-path finder waits for mergekit's method registry,
planner and merge modules to finish loading, then calls that function with
eager=False. It never raises; MERGEKIT_RAM_AUTOLOAD=0 switches it off.
"""

import importlib
import os
import sys

WATCHED = ("mergekit.merge_methods", "mergekit.plan", "mergekit.merge")
LOADING = set()  # the watched modules whose import is still running
_installer = None  # "module:function", set by activate()
_warned = False


def enabled():
    value = os.environ.get("MERGEKIT_RAM_AUTOLOAD", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def _ours_importing():
    """Whether one of our modules is mid-import (it imported mergekit itself).

    Installing then would need that half-made module; the next watched
    module, or the entry point, installs instead.
    """
    return any(
        getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
        if name.startswith("mergekit_ram.")
    )


def _loaded(name):
    global _warned
    if not enabled() or not _installer or _ours_importing():
        return
    try:
        module, _, function = _installer.partition(":")
        getattr(importlib.import_module(module), function)(eager=False)
    except Exception as error:  # a start-up hook must never break mergekit
        if not _warned:
            _warned = True
            # Other methods stay mergekit's own; ram / ramplus are refused.
            sys.stderr.write(f"mergekit-ram: not installed ({name}): {error}\n")


class _Loader:
    """The watched module's own loader, noting while it runs (create_module
    and the rest are the inner loader's)."""

    def __init__(self, inner, name):
        self._inner, self._name = inner, name

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def exec_module(self, module):
        LOADING.add(self._name)
        try:
            self._inner.exec_module(module)
        finally:
            LOADING.discard(self._name)
        _loaded(self._name)


class _Finder:
    """Wraps the loaders of the watched mergekit modules; finds nothing itself."""

    def find_spec(self, name, path=None, target=None):
        if name not in WATCHED:
            return None
        try:
            finders = [f for f in sys.meta_path if hasattr(f, "find_spec")]
            found = (f.find_spec(name, path, target) for f in finders if f is not self)
            spec = next(filter(None, found), None)
            if spec is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader, name)
        except Exception:
            return None
        return spec


def activate(installer):
    """Call `installer` ("module:function") when mergekit is imported."""
    global _installer
    _installer = installer
    if enabled() and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
