"""`knorm` — keep the keys of lowest L2 norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy
for KV Cache Compression", arXiv 2406.11430; NVIDIA kvpress's KnormPress), with sinks and a window.

Keep the stream's first `sinks` tokens, the last `recent` entries, and among the others the `low_norm` entries whose
keys have the smallest norm (a low-norm key draws high attention, the paper finds). A rotation keeps a key's norm, so
rolling or not ranks alike. Decided per layer and KV head from the keys alone: no attention scores (the fused
attention path stays).

Default split: 4 sinks (StreamingLLM's), half the cache by key norm, the rest recent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import RECENT, SINKS, Entries, EvictionPolicy, Part
from .registry import register

if TYPE_CHECKING:
    import torch


@register
@dataclass
class KnormPolicy(EvictionPolicy):
    sinks: int
    low_norm: int
    recent: int
    name = "knorm"
    parts = (SINKS, Part("low_norm", "slots for the keys of lowest L2 norm", share=0.5), RECENT)

    def score(self, entries: Entries) -> torch.Tensor:
        return -entries.keys.norm(dim=-1)
