"""Eviction policies, one per file, registered by name."""

from . import full, h2o, sink, window  # noqa: F401  (importing registers them)
from .base import EvictionPolicy
from .registry import POLICIES, policy_class, register
from .split import make_policy

__all__ = ["EvictionPolicy", "POLICIES", "make_policy", "policy_class", "register"]
