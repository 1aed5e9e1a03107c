"""Eviction policies, one per file, registered by name: every module of this folder is imported here, so a new policy
is one new file with `@register` on its class and nothing else.

Importing this package (the registry and every policy's declarations) loads no torch: the command line builds its
options from the declarations, and `h2o-stream --help` must not wait seconds for torch. A policy module imports torch
only under TYPE_CHECKING at its top and inside the functions that call it (tests/cli/test_cli_startup.py checks).
"""

import importlib
import pkgutil

from .base import EvictionPolicy, Part, Setting
from .ranking import Entries, Ranking
from .registry import POLICIES, declared_options, declared_parts, policy_class, register
from .split import make_policy

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # importing a policy module registers it

__all__ = [
    "Entries",
    "EvictionPolicy",
    "POLICIES",
    "Part",
    "Ranking",
    "Setting",
    "declared_options",
    "declared_parts",
    "make_policy",
    "policy_class",
    "register",
]
