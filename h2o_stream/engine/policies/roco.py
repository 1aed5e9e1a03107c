"""`roco` — RoCo, a robust cache omission policy (Ren & Zhu 2024, "On the Efficacy of Eviction Policy for Key-Value
Constrained Generative Language Model Inference", arXiv 2402.06262; official code: DRSY/EasyKV, mode 'roco').

Per layer and KV head (query heads of a group summed), every entry keeps the attention it received and the sum of its
squares over its steps in the cache (its age: one step per query that has seen it, its own included). Its *mean*
attention is the sum over its age, so old entries no longer win by having been around longest (H2O's sum does);
its *variance* (mean of squares minus squared mean) says how much that attention fluctuates. Keep the last `recent`
entries, then among the others the `volatile` ones whose attention varies most (not safely judged by their mean: the
paper's robustness measure narrows the eviction scope to the steadier entries), then among the rest the `heavy` with
the highest mean attention. Ties go to the older entry. Variance is ranked as it is, not its square root as the
official code does: the same order, without a NaN where rounding makes it slightly negative.

Default split: the official code's: the 10 newest entries, 0.3 of the cache volatile, the rest heavy. In its decode
loop the 0.3 also covers those 10 newest and the step's new entry, so it keeps 9 volatile slots fewer (e.g. at 256:
recent 10, volatile 67, heavy 179); `--volatile 67` gives that split. Default mode: exact (one token per decision).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionPolicy, Part, Scores
from .ranking import MEAN
from .registry import register


@register
@dataclass
class RoCoPolicy(EvictionPolicy):
    volatile: int
    heavy: int
    recent: int
    name = "roco"
    parts = (
        Part("volatile", "slots for the entries whose attention varies most (never judged by their mean)", share=0.3),
        Part("heavy", "slots for the highest mean attention (over their time in the cache) among the steadier entries"),
        Part("recent", "recent-window slots, the last entries", fixed=10),
    )  # the official code's 10 newest
    scoring = Scores("moments")
    ranking = MEAN  # the `volatile` of highest variance first, then the highest means
    # exact mode by default: chunks up to its window + 1 (8) sat below exact mode (eval/results/quality/gap.json)
    # and ran slower than exact mode does compiled (eval/results/speed/exact_scan.json)
    fair_chunk_share = 0.0
