"""`tova` — TOVA, Token Omission Via Attention (Oren et al. 2024, "Transformers are Multi-State RNNs").

At every step, keep the `states` entries the current query attends to most, its attention averaged over all query
heads of the layer: one decision per layer, shared by every KV head, and no fixed recent window (the newest token
competes like any other). Follows the official code (schwartz-lab-NLP/TOVA, `src/tova_cache.py`): the mean over
heads of the last query's attention, top-`states` kept. Ties go to the older entry. `per_head=True` decides per KV
head instead (the query heads reading it summed), the variant the paper reports as worse.

Default split: the whole cache is `states` (TOVA has no other part). In a chunk only the last query's attention
counts, as the official code does for a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionPolicy, Part, Scores, setting
from .ranking import SCORE
from .registry import register


@register
@dataclass
class TOVAPolicy(EvictionPolicy):
    states: int
    per_head: bool = setting(
        False, "decide per KV head instead of once per layer (TOVA averages over the layer's heads)"
    )
    name = "tova"
    parts = (Part("states", "TOVA's states: slots ranked by the current query's attention"),)
    scoring = Scores("latest", heads="per_head")  # the layer's mean, or per KV head with per_head
    ranking = SCORE
