"""`a2sf` — A2SF, Accumulative Attention Scoring with Forgetting Factor (Jo & Shin 2024, arXiv 2407.20485).

H2O whose scores forget: at every step each entry's score is multiplied by `alpha` before the attention it just
received is added (A <- alpha * A + a_t), so old attention fades instead of piling up on the stream's first tokens.
Keep the last `recent` entries plus the `heavy` highest-scored among the rest; ties go to the older entry; decided
per layer and KV head (query heads of a group summed). `alpha = 1` is H2O.

Default split: half heavy, half recent (H2O's); `alpha` 0.95 — our default (a half-life of about 14 steps), not the
paper's, which tunes the factor per model and task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from h2o_stream.errors import H2OStreamError

from ..memo import memoised
from .base import HEAVY, RECENT, DropOne, EvictionPolicy, Setting
from .slots import keep_top
from .registry import register


@register
@dataclass
class A2SFPolicy(EvictionPolicy):
    heavy: int
    recent: int
    alpha: float = 0.95
    name = "a2sf"
    needs_scores = True
    parts = (HEAVY, RECENT)
    cuts_nest = True
    options = (Setting("alpha", "forgetting factor in (0, 1]: scores are multiplied by it at every step", 0.95),)

    def __post_init__(self):
        super().__post_init__()
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0 < alpha <= 1) \
                or not math.isfinite(alpha):
            raise H2OStreamError(f"alpha (the a2sf forgetting factor) must be a number in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)

    def update_scores(self, scores: torch.Tensor, received: torch.Tensor, steps: int = 1) -> None:
        scores.mul_(self.alpha ** steps).add_(received)  # `steps` decays, as many steps would

    def query_weights(self, length: int) -> torch.Tensor | None:
        return _decays(self.alpha, length)

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        n = positions.shape[-1]
        return keep_top(scores[..., : n - self.recent], self.heavy, sinks=0, recent=self.recent)

    def drop_one(self) -> DropOne:
        return DropOne(sinks=0, recent=self.recent, ranked=True, decay=self.alpha)


@memoised(32)
def _decays(alpha: float, length: int) -> torch.Tensor:
    """Query i's weight in a chunk of `length`: its attention is decayed by the length - 1 - i steps after it.
    Memoised (every layer of every chunk asks for the same); never modify the result."""
    import torch
    return alpha ** torch.arange(length - 1, -1, -1, dtype=torch.float64)
