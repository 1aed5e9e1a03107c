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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from .base import DropOne, EvictionPolicy, Part
from .slots import ages, last_slots, top_slots
from .registry import register


@register
@dataclass
class RoCoPolicy(EvictionPolicy):
    volatile: int
    heavy: int
    recent: int
    name = "roco"
    needs_scores = True
    score_squares = True
    # exact mode by default: chunks up to its window + 1 (8) sat below exact mode (eval/results/quality/gap.json)
    # and ran slower than exact mode does compiled (eval/results/speed/exact_scan.json)
    fair_chunk_share = 0.0
    parts = (Part("volatile", "slots for the entries whose attention varies most (never judged by their mean)",
                  share=0.3),
             Part("heavy", "slots for the highest mean attention (over their time in the cache) among the steadier "
                           "entries"),
             Part("recent", "recent-window slots, the last entries", fixed=10))  # the official code's 10 newest

    @property
    def cuts_nest(self) -> bool:
        # Ages count from the newest entry; a cut that keeps it leaves every mean and variance as they were.
        return self.recent >= 1

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        import torch
        n = positions.shape[-1]
        others = n - self.recent
        age = ages(positions)[..., :others].to(scores.dtype)
        mean = scores[..., :others, 0] / age
        variance = scores[..., :others, 1] / age - mean.square()
        # The volatile entries ranked above every mean, then the top volatile + heavy of that order: the volatile
        # and, among the rest, the highest means, in slot order, from one ranking (keep runs per layer and block;
        # in exact mode it drops one entry without a sort). top_slots gives ties to the older entry.
        volatile = top_slots(variance, self.volatile, in_slot_order=False)
        ranks = mean.scatter(-1, volatile, float("inf"))
        kept = top_slots(ranks, self.volatile + self.heavy)
        return torch.cat([kept, last_slots(n, self.recent, positions)], dim=-1)

    def drop_one(self) -> DropOne:
        return DropOne(sinks=0, recent=self.recent, ranked=True, by_mean=True, volatile=self.volatile)
