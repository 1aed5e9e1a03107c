"""`h2o` (Heavy-Hitter Oracle): keep the last `recent` entries plus the `heavy` highest-scored among the rest.

A score is the attention probability an entry has received, summed over every step since it entered the cache (the
query heads of a GQA group add up into their KV head). Ties go to the older entry. Decided per layer and per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_stream.errors import H2OStreamError
from .base import EvictionPolicy, _need_size, check_count, last_slots
from .registry import register


@register
@dataclass
class H2OPolicy(EvictionPolicy):
    heavy: int
    recent: int
    name = "h2o"
    needs_scores = True
    parts = ("heavy", "recent")

    @classmethod
    def from_budget(cls, cache_size, heavy=None, recent=None):
        _need_size(cls.name, cache_size)
        if heavy is None:
            heavy = cache_size // 2 if recent is None else cache_size - recent
        return cls(heavy=heavy, recent=cache_size - heavy if recent is None else recent)

    def __post_init__(self):
        check_count("heavy", self.heavy)
        check_count("recent", self.recent)
        if self.heavy + self.recent < 1:
            raise H2OStreamError("h2o policy needs heavy + recent >= 1")

    @property
    def budget(self) -> int:
        return self.heavy + self.recent

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        n = positions.shape[-1]
        candidates = scores[..., : n - self.recent]
        # A stable descending sort keeps equal scores in slot (= stream) order, so ties favour the older entry.
        order = torch.sort(candidates, dim=-1, descending=True, stable=True).indices
        heavy = order[..., : self.heavy].sort(dim=-1).values
        return torch.cat([heavy, last_slots(n, self.recent, positions)], dim=-1)
