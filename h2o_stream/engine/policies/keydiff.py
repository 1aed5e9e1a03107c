"""`keydiff` — KeyDiff (Park et al. 2025, arXiv 2504.15364; NVIDIA kvpress's KeyDiffPress), with sinks and a window.

Keep the stream's first `sinks` tokens, the last `recent` entries, and among the others the `diverse` entries whose
keys are least similar (cosine) to the layer's anchor key: the mean of the unit-normalised keys of every entry the KV
head holds (kvpress's anchor). Keys are taken as the layer stores them: un-rotated with rolling, rotated at their
stream positions without. Equal similarities go to the older entry. Decided per layer and KV head; needs no
attention scores (the fused attention path stays).

Default split: 4 sinks (StreamingLLM's), half the cache diverse, the rest recent.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import RECENT, SINKS, EvictionPolicy, Part
from .ranking import KEY_DIVERSITY
from .registry import register


@register
@dataclass
class KeyDiffPolicy(EvictionPolicy):
    sinks: int
    diverse: int
    recent: int
    name = "keydiff"
    parts = (SINKS, Part("diverse", "slots for the keys least similar to the mean key", share=0.5), RECENT)
    ranking = KEY_DIVERSITY
