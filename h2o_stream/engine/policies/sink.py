"""`sink` (StreamingLLM): keep stream tokens 0..sinks-1 and the last `recent` entries."""

from __future__ import annotations

from dataclasses import dataclass

from .base import RECENT, SINKS, EvictionPolicy
from .ranking import AGE
from .registry import register


@register
@dataclass
class SinkPolicy(EvictionPolicy):
    sinks: int
    recent: int
    name = "sink"
    parts = (SINKS, RECENT)
    ranking = AGE  # nothing ranked: the sinks and the recent window, a band
