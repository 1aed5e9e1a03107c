"""`snapkv` — SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv
2404.14469; official code FasterDecoding/SnapKV, `snapkv_utils.py`), applied at every cut of a stream.

An entry's score is the attention it received from the latest `observation` queries (the observation window; by
default as many as the recent window keeps, as in the official code, where the window is what it keeps), their
query heads summed per KV head; the scores are pooled over neighbouring entries (a window of `kernel` slots centred on
each, averaged with the padding counted as 0, as `avg_pool1d`; the maximum with `max_pool`), so that a kept entry
brings its neighbourhood; keep the last `recent` entries and the `heavy` highest pooled scores among the rest, ties
to the older entry. The official code compresses a prompt once; here every cut is such a compression, with the
latest queries of the stream as the window (in exact mode the last `observation` steps, in a fair chunk they run on
into the chunks before). Decided per layer and KV head.

Default settings: the official code's kernel 5 and average pooling, the observation window the recent window. Default
split: an eighth of the cache recent (32 slots at 256, the official code's window of 32; 64 at 512, kvpress's), the
rest heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionPolicy, Part, Scores, setting
from .ranking import POOLED
from .registry import register


@register
@dataclass
class SnapKVPolicy(EvictionPolicy):
    heavy: int
    recent: int
    observation: int = setting(
        0,
        "queries in the observation window (the latest ones; 0: as many as the recent "
        "window keeps, as the official code)",
        within=(-1, 4096),
        called="0: the recent window's length",
    )
    kernel: int = setting(5, "pooling kernel in slots (odd)", within=(0, 4095), odd=True)
    max_pool: bool = setting(False, "pool by the maximum instead of the average")
    name = "snapkv"
    parts = (
        Part("heavy", "slots for the highest pooled attention from the observation window"),
        Part("recent", "recent-window slots, the last entries", share=1 / 8),
    )
    scoring = Scores("window", window="observation")
    ranking = POOLED

    def __post_init__(self):
        super().__post_init__()
        if self.observation == 0:  # the official code's window is the one it keeps
            self.observation = max(self.recent, 1)
