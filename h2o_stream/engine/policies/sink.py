"""`sink` (StreamingLLM): keep stream tokens 0..sinks-1 and the last `recent` entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from .base import RECENT, SINKS, DropOne, EvictionPolicy
from .slots import first_slots, last_slots
from .registry import register


@register
@dataclass
class SinkPolicy(EvictionPolicy):
    sinks: int
    recent: int
    name = "sink"
    parts = (SINKS, RECENT)

    def band(self) -> tuple[int, int]:
        return self.sinks, self.recent

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        # The sinks are the first stream tokens; once the cache is past them they always sit in slots 0..sinks-1.
        import torch
        n = positions.shape[-1]
        return torch.cat([first_slots(self.sinks, positions), last_slots(n, self.recent, positions)], dim=-1)

    def drop_one(self) -> DropOne:
        return DropOne(sinks=self.sinks, recent=self.recent, ranked=False)
