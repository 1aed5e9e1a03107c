"""`h2o` (Heavy-Hitter Oracle): keep the last `recent` entries plus the `heavy` highest-scored among the rest.

A score is the attention probability an entry has received, summed over every step since it entered the cache (the
query heads of a GQA group add up into their KV head). Ties go to the older entry. Decided per layer and per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import HEAVY, RECENT, EvictionPolicy, Scores
from .ranking import SCORE
from .registry import register


@register
@dataclass
class H2OPolicy(EvictionPolicy):
    heavy: int
    recent: int
    name = "h2o"
    parts = (HEAVY, RECENT)
    scoring = Scores("sum")
    ranking = SCORE
