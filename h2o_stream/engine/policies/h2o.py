"""`h2o` (Heavy-Hitter Oracle): keep the last `recent` entries plus the `heavy` highest-scored among the rest.

A score is the attention probability an entry has received, summed over every step since it entered the cache (the
query heads of a GQA group add up into their KV head). Ties go to the older entry. Decided per layer and per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import RECENT, EvictionPolicy, Part, last_slots
from .registry import register


@register
@dataclass
class H2OPolicy(EvictionPolicy):
    heavy: int
    recent: int
    name = "h2o"
    needs_scores = True
    parts = (Part("heavy", "heavy-hitter slots, the highest-scored older entries", share=0.5),  # the paper's split
             RECENT)

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        n = positions.shape[-1]
        candidates = scores[..., : n - self.recent]
        # A stable descending sort keeps equal scores in slot (= stream) order, so ties favour the older entry.
        order = torch.sort(candidates, dim=-1, descending=True, stable=True).indices
        heavy = order[..., : self.heavy].sort(dim=-1).values
        return torch.cat([heavy, last_slots(n, self.recent, positions)], dim=-1)
