"""Makes this Python look like the GPU machine: torch and its basics, none of the modules
named in KNAPRAY_HIDE_MODULES (comma-separated top-level names, e.g. ray,tensorboard).

Loaded at interpreter start-up when this directory is on PYTHONPATH (tests/dist/test_torchrun.py
puts it there for its subprocesses, whose own children inherit it). A hidden module is not
found: ``importlib.util.find_spec`` returns None and ``import`` raises ModuleNotFoundError,
as where it is not installed. As there, a directory of that name without ``__init__.py`` on
the path (``tests/ray/``, with ``tests/`` on sys.path) is still found, as an empty namespace
package: the GPU machine showed that (``import ray`` worked, ``ray.autoscaler`` did not).
"""

import glob
import importlib.machinery
import os
import sys

_HIDDEN = frozenset(m for m in os.environ.get("KNAPRAY_HIDE_MODULES", "").split(",") if m)


class _Hide:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            if self._finder is not importlib.machinery.PathFinder:
                return None
            if path is None:  # a top-level name: the path entries that do not install it
                path = [p for p in sys.path if not _installs(p, name)]
            spec = self._finder.find_spec(name, path, target)
            return spec if spec is not None and spec.origin is None else None  # namespace packages only
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


def _installs(entry, name):
    """Whether sys.path entry ``entry`` holds ``name`` as a module or a regular package."""
    return os.path.isfile(os.path.join(entry or ".", name, "__init__.py")) or bool(
        glob.glob(os.path.join(glob.escape(entry or "."), name + ".*")))


if _HIDDEN:
    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
