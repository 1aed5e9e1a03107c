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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from h2o_stream.errors import H2OStreamError

from .base import DropOne, EvictionPolicy, Part, Setting
from .slots import top_slots
from .registry import register


@register
@dataclass
class TOVAPolicy(EvictionPolicy):
    states: int
    per_head: bool = False
    name = "tova"
    needs_scores = True
    score_queries = "last"
    cuts_nest = True
    parts = (Part("states", "TOVA's states: slots ranked by the current query's attention"),)
    options = (Setting("per_head", "decide per KV head instead of once per layer (TOVA averages over the "
                                   "layer's heads)", False),)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.per_head, bool):
            raise H2OStreamError(f"per_head must be true or false, got {self.per_head!r}")

    @property
    def score_heads(self) -> str:
        return "kv" if self.per_head else "layer"

    def update_scores(self, scores: torch.Tensor, received: torch.Tensor, steps: int = 1) -> None:
        scores.copy_(received)  # only the current query's attention counts

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        return top_slots(scores, self.states)

    def drop_one(self) -> DropOne:
        return DropOne(sinks=0, recent=0, ranked=True, latest_only=True)
