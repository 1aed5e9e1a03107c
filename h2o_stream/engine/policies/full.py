"""`full`: never evict. The reference for 'no eviction'; memory grows with the stream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from .base import EvictionPolicy
from .registry import register


@register
@dataclass
class FullPolicy(EvictionPolicy):
    name = "full"  # no parts: the budget is None (unbounded) and a cache size is ignored

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        raise AssertionError("the full policy never evicts")
