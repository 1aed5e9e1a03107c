"""`a2sf` — A2SF, Accumulative Attention Scoring with Forgetting Factor (Jo & Shin 2024, arXiv 2407.20485).

H2O whose scores forget: at every step each entry's score is multiplied by `alpha` before the attention it just
received is added (A <- alpha * A + a_t), so old attention fades instead of piling up on the stream's first tokens.
Keep the last `recent` entries plus the `heavy` highest-scored among the rest; ties go to the older entry; decided
per layer and KV head (query heads of a group summed). `alpha = 1` is H2O.

Default split: half heavy, half recent (H2O's); `alpha` 0.95 — our default (a half-life of about 14 steps), not the
paper's, which tunes the factor per model and task.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import HEAVY, RECENT, EvictionPolicy, Scores, setting
from .ranking import SCORE
from .registry import register


@register
@dataclass
class A2SFPolicy(EvictionPolicy):
    heavy: int
    recent: int
    alpha: float = setting(
        0.95,
        "forgetting factor in (0, 1]: scores are multiplied by it at every step",
        within=(0, 1),
        called="the a2sf forgetting factor",
    )
    name = "a2sf"
    parts = (HEAVY, RECENT)
    scoring = Scores("decay", decay="alpha")
    ranking = SCORE
