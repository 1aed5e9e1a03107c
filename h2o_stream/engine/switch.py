"""Whether the engine's compiled parts run (engine/compiled.py, engine/compiled_counts.py, engine/compiled_merge.py,
engine/compiled_cuts.py): not without numba, nor with H2O_STREAM_COMPILED=0 (read at every call, so that one
process can compare both ways); the tensor operations run in their place."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType


def compiled_part(name: str) -> ModuleType | None:
    """The engine module `name` (numba-compiled), or None where it cannot run or is switched off."""
    if os.environ.get("H2O_STREAM_COMPILED", "1") == "0":
        return None
    return _import(name)


@functools.cache
def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError:  # numba not installed
        return None
