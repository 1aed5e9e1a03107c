"""`window`: keep the last `recent` entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictionPolicy, _need_size, check_count, last_slots
from .registry import register


@register
@dataclass
class WindowPolicy(EvictionPolicy):
    recent: int
    name = "window"
    parts = ("recent",)

    @classmethod
    def from_budget(cls, cache_size, recent=None):
        _need_size(cls.name, cache_size)
        return cls(recent=cache_size if recent is None else recent)

    def __post_init__(self):
        check_count("recent", self.recent, minimum=1)

    @property
    def budget(self) -> int:
        return self.recent

    def band(self) -> tuple[int, int]:
        return 0, self.recent

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        return last_slots(positions.shape[-1], self.recent, positions)
