"""`full`: never evict. The reference for 'no eviction'; memory grows with the stream."""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionPolicy
from .registry import register


@register
@dataclass
class FullPolicy(EvictionPolicy):
    name = "full"  # no parts: the budget is None (unbounded) and a cache size is ignored
