"""`random` — a seeded random choice among the older entries, with sinks and a window: the control that says
whether a policy's score matters at all.

Keep the stream's first `sinks` tokens, the last `recent` entries, and `chosen` of the others at random. Each entry
draws one number from (`choice_seed`, its layer, its KV head, its stream position) and the highest draws are kept:
at any time the kept ones are a uniform random sample of every entry that has left the recent window (priority
sampling), the same in exact mode and in fair chunks, and again on every run. No attention scores (the fused attention
path stays).

Default split: 4 sinks (StreamingLLM's), half the cache chosen, the rest recent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import RECENT, SINKS, Entries, EvictionPolicy, Part, setting
from .registry import register

if TYPE_CHECKING:
    import torch


@register
@dataclass
class RandomPolicy(EvictionPolicy):
    sinks: int
    chosen: int
    recent: int
    choice_seed: int = setting(0, "the seed of the random choice", within=(-1, 2**32 - 1))
    name = "random"
    parts = (SINKS, Part("chosen", "slots for older entries chosen at random", share=0.5), RECENT)

    def score(self, entries: Entries) -> torch.Tensor:
        from ..draws import entry_uniforms

        return entry_uniforms(self.choice_seed, entries.layer, entries.positions)
