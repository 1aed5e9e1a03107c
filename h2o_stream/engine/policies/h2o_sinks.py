"""`h2o_sinks` — H2O (Zhang et al. 2023) with protected attention sinks (Xiao et al. 2024, StreamingLLM).

Keep the stream's first `sinks` tokens for good, the last `recent` entries, and the `heavy` highest-scored among the
others, scores being H2O's (attention received, summed over every step; query heads of a GQA group summed); ties go
to the older entry; decided per layer and KV head. With `sinks = 0` it is `h2o`.

Default split: 4 sinks (StreamingLLM's), then half the cache heavy, the rest recent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from .base import HEAVY, RECENT, SINKS, DropOne, EvictionPolicy
from .slots import keep_top
from .registry import register


@register
@dataclass
class H2OSinksPolicy(EvictionPolicy):
    sinks: int
    heavy: int
    recent: int
    name = "h2o_sinks"
    needs_scores = True
    parts = (SINKS, HEAVY, RECENT)
    cuts_nest = True

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        # The sinks are never cut and are the oldest entries, so past the first cut they sit in slots 0..sinks-1.
        n = positions.shape[-1]
        return keep_top(scores[..., self.sinks: n - self.recent], self.heavy, sinks=self.sinks, recent=self.recent)

    def drop_one(self) -> DropOne:
        return DropOne(sinks=self.sinks, recent=self.recent, ranked=True)
