"""`sink` (StreamingLLM): keep stream tokens 0..sinks-1 and the last `recent` entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import RECENT, EvictionPolicy, Part, last_slots
from .registry import register


@register
@dataclass
class SinkPolicy(EvictionPolicy):
    sinks: int
    recent: int
    name = "sink"
    parts = (Part("sinks", "attention-sink slots, the stream's first tokens", fixed=4),  # StreamingLLM's choice
             RECENT)

    def band(self) -> tuple[int, int]:
        return self.sinks, self.recent

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        # The sinks are the first stream tokens; once the cache is past them they always sit in slots 0..sinks-1.
        n = positions.shape[-1]
        first = torch.arange(self.sinks, device=positions.device).expand(*positions.shape[:2], self.sinks)
        return torch.cat([first, last_slots(n, self.recent, positions)], dim=-1)
