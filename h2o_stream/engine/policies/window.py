"""`window`: keep the last `recent` entries."""

from __future__ import annotations

from dataclasses import dataclass

from .base import RECENT, EvictionPolicy
from .ranking import AGE
from .registry import register


@register
@dataclass
class WindowPolicy(EvictionPolicy):
    recent: int
    name = "window"
    parts = (RECENT,)
    ranking = AGE  # nothing ranked: the recent window, a band
