"""``needs(*modules)``: a skip mark for a missing optional package, found without importing it."""

from __future__ import annotations

import importlib.util

import pytest


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip where one of ``modules`` is not installed, without importing any: a test module is
    imported again by every process it spawns (its functions are pickled by module name), and
    ``pytest.importorskip("diffusers")`` at its top cost each gloo rank 3 s of CPU."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (the test extra)")
