"""`h2o_sinks` — H2O (Zhang et al. 2023) with protected attention sinks (Xiao et al. 2024, StreamingLLM).

Keep the stream's first `sinks` tokens for good, the last `recent` entries, and the `heavy` highest-scored among the
others, scores being H2O's (attention received, summed over every step; query heads of a GQA group summed); ties go
to the older entry; decided per layer and KV head. With `sinks = 0` it is `h2o`.

Default split: 4 sinks (StreamingLLM's), then half the cache heavy, the rest recent.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import HEAVY, RECENT, SINKS, EvictionPolicy, Scores
from .ranking import SCORE
from .registry import register


@register
@dataclass
class H2OSinksPolicy(EvictionPolicy):
    sinks: int
    heavy: int
    recent: int
    name = "h2o_sinks"
    parts = (SINKS, HEAVY, RECENT)
    scoring = Scores("sum")
    ranking = SCORE
