"""`window`: keep the last `recent` entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from .base import RECENT, DropOne, EvictionPolicy
from .slots import last_slots
from .registry import register


@register
@dataclass
class WindowPolicy(EvictionPolicy):
    recent: int
    name = "window"
    parts = (RECENT,)

    def band(self) -> tuple[int, int]:
        return 0, self.recent

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        return last_slots(positions.shape[-1], self.recent, positions)

    def drop_one(self) -> DropOne:
        return DropOne(sinks=0, recent=self.recent, ranked=False)
