"""Makes this Python look like the GPU machine: torch and its basics, none of the modules
named in KNAPRAY_HIDE_MODULES (comma-separated top-level names, e.g. ray,tensorboard).

Loaded at interpreter start-up when this directory is on PYTHONPATH (tests/dist/test_torchrun.py
puts it there for its subprocesses, whose own children inherit it). A hidden module is not
found: ``importlib.util.find_spec`` returns None and ``import`` raises ModuleNotFoundError,
as where it is not installed.
"""

import os
import sys

_HIDDEN = frozenset(m for m in os.environ.get("KNAPRAY_HIDE_MODULES", "").split(",") if m)


class _Hide:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


if _HIDDEN:
    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
