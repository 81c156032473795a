"""RAM and RAM+ (Reinforced Agent Merging) for mergekit.

Importing this package makes `ram` and `ramplus` available to mergekit
without importing mergekit itself: when mergekit is already loaded they are
installed at once, otherwise the start-up hook installs them as soon as
mergekit is imported. The Python API mirrors mergekit's: run_merge,
merge_tensors, merge_state_dicts.
"""

import sys

import _mergekit_ram_autoload as _autoload
from mergekit_ram.commands.install import install

__version__ = "0.1.0"
__all__ = ["install", "merge_state_dicts", "merge_tensors", "run_merge"]

_API = ("merge_state_dicts", "merge_tensors", "run_merge")


def __getattr__(name: str):
    # Lazy: the API imports mergekit, which this package must not do itself.
    if name in _API:
        install()  # the host probed before the API's modules, which rely on it
        from mergekit_ram.commands import api

        return getattr(api, name)
    raise AttributeError(f"module 'mergekit_ram' has no attribute {name!r}")


_autoload.activate("mergekit_ram.commands.install:install")
if "mergekit" in sys.modules:
    # Imported from the autoload hook while mergekit is half-loaded: finish later.
    install(eager=not _autoload.LOADING)
