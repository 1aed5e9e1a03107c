"""`sink` (StreamingLLM): keep stream tokens 0..sinks-1 and the last `recent` entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2o_stream.errors import H2OStreamError
from .base import EvictionPolicy, _need_size, check_count, last_slots
from .registry import register


@register
@dataclass
class SinkPolicy(EvictionPolicy):
    sinks: int
    recent: int
    name = "sink"
    parts = ("sinks", "recent")
    default_sinks = 4  # StreamingLLM's choice

    @classmethod
    def from_budget(cls, cache_size, sinks=None, recent=None):
        _need_size(cls.name, cache_size)
        if sinks is None:
            sinks = min(cls.default_sinks, cache_size) if recent is None else cache_size - recent
        return cls(sinks=sinks, recent=cache_size - sinks if recent is None else recent)

    def __post_init__(self):
        check_count("sinks", self.sinks)
        check_count("recent", self.recent)
        if self.sinks + self.recent < 1:
            raise H2OStreamError("sink policy needs sinks + recent >= 1")

    @property
    def budget(self) -> int:
        return self.sinks + self.recent

    def band(self) -> tuple[int, int]:
        return self.sinks, self.recent

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        # The sinks are the first stream tokens; once the cache is past them they always sit in slots 0..sinks-1.
        n = positions.shape[-1]
        first = torch.arange(self.sinks, device=positions.device).expand(*positions.shape[:2], self.sinks)
        return torch.cat([first, last_slots(n, self.recent, positions)], dim=-1)

