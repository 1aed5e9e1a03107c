"""`scissorhands` — Scissorhands (Liu et al., NeurIPS 2023, "Scissorhands: Exploiting the Persistence of Importance
Hypothesis for LLM KV Cache Compression at Test Time", arXiv 2305.17118; official code lzcemma/Scissorhands,
`hf_opt_dropkv.py`), with a fixed budget.

Persistence of importance: an entry that was important to recent queries stays important. An entry is important to
a query head when it gets more than the 90% quantile of that head's attention row (the official code's threshold:
the value at ascending index floor(0.9 n) of the row's n keys); its score counts, over the latest `history` queries
(steps), the query heads reading its KV head that found it important. Keep the last `recent` entries and the `heavy`
highest counts among the others, ties to the older entry; decided per layer and KV head (the query heads of a GQA
group add up).

Where the official code differs: it evaluates by masking, for every query, the keys no query of the last `history`
found important (outside the last `recent`), so what it keeps varies from query to query with no budget; its
algorithm for generation drops a share of the cache at once when it is full. Here every cut keeps the budget, the
fewest counts going first (as a budgeted cache must). Defaults: the official code's run scripts' history of 100
queries and recent window of 10; the rest heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionPolicy, Part, Scores, setting
from .ranking import SCORE
from .registry import register


@register
@dataclass
class ScissorhandsPolicy(EvictionPolicy):
    heavy: int
    recent: int
    history: int = setting(
        100,
        "the latest queries whose importance counts (Scissorhands' history window)",
        within=(0, 1 << 16),
        called="scissorhands' history window",
        example=6,
    )
    quantile: float = setting(
        0.9,
        "an entry is important to a query head above this quantile of its attention row",
        within=(0, 1),
        called="scissorhands' importance quantile",
        example=0.6,  # in a row of 9 keys (a tiny cache) 0.9 is its largest value: nothing is above it
    )
    name = "scissorhands"
    parts = (
        Part("heavy", "slots for the entries the latest queries found important most often"),
        Part("recent", "recent-window slots, the last entries", fixed=10),
    )
    scoring = Scores("window", window="history", quantile="quantile")
    ranking = SCORE
