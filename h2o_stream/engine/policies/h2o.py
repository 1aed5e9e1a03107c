"""`h2o` (Heavy-Hitter Oracle): keep the last `recent` entries plus the `heavy` highest-scored among the rest.

A score is the attention probability an entry has received, summed over every step since it entered the cache (the
query heads of a GQA group add up into their KV head). Ties go to the older entry. Decided per layer and per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from .base import HEAVY, RECENT, DropOne, EvictionPolicy
from .slots import keep_top
from .registry import register


@register
@dataclass
class H2OPolicy(EvictionPolicy):
    heavy: int
    recent: int
    name = "h2o"
    needs_scores = True
    parts = (HEAVY, RECENT)
    cuts_nest = True

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        n = positions.shape[-1]
        return keep_top(scores[..., : n - self.recent], self.heavy, sinks=0, recent=self.recent)

    def drop_one(self) -> DropOne:
        return DropOne(sinks=0, recent=self.recent, ranked=True)
