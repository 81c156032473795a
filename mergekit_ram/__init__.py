"""RAM and RAM+ (Reinforced Agent Merging) for mergekit.

Importing this package registers `ram` and `ramplus` with mergekit. The
Python API mirrors mergekit's: run_merge, merge_tensors, merge_state_dicts.
"""

import _mergekit_ram_autoload as _autoload
from mergekit_ram.install import install

__version__ = "0.1.0"
__all__ = ["install", "merge_state_dicts", "merge_tensors", "run_merge"]

# Imported from the autoload hook while mergekit is half-loaded, finish later.
install(eager=not _autoload.busy())


def __getattr__(name: str):
    # Lazy: mergekit.merge may still be importing when the hook imports us.
    if name in ("merge_state_dicts", "merge_tensors", "run_merge"):
        from mergekit_ram import api

        return getattr(api, name)
    raise AttributeError(f"module 'mergekit_ram' has no attribute {name!r}")
