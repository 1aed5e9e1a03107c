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

import torch

from .base import RECENT, SINKS, EvictionPolicy, Part, keep_top
from .registry import register


def anchor_similarity(keys: torch.Tensor) -> torch.Tensor:
    """Every key's (batch, heads, n, dim) cosine similarity to the mean of the unit-normalised keys, times that mean's
    norm (the same for every key of a head, so the order is the cosine's): (batch, heads, n), in float64 (float32 on
    MPS) so that the ranking does not hinge on rounding.

    Written as two small products instead of normalising every key: a cut's `keep` runs per layer and block, and
    normalising and `cosine_similarity` made it ten times h2o's."""
    keys = keys.to(torch.float32 if keys.device.type == "mps" else torch.float64)
    inverse_norms = torch.linalg.vector_norm(keys, dim=-1).clamp_min(1e-12).reciprocal()  # (batch, heads, n)
    anchor = torch.matmul(inverse_norms.unsqueeze(-2), keys) / keys.shape[-2]  # (batch, heads, 1, dim)
    return torch.matmul(keys, anchor.transpose(-1, -2)).squeeze(-1) * inverse_norms


@register
@dataclass
class KeyDiffPolicy(EvictionPolicy):
    sinks: int
    diverse: int
    recent: int
    name = "keydiff"
    needs_keys = True
    parts = (SINKS, Part("diverse", "slots for the keys least similar to the mean key", share=0.5), RECENT)

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None, *, keys: torch.Tensor) -> torch.Tensor:
        # The sinks are never cut and are the oldest entries, so past the first cut they sit in slots 0..sinks-1.
        n = positions.shape[-1]
        similarity = anchor_similarity(keys)[..., self.sinks: n - self.recent]
        return keep_top(-similarity, self.diverse, sinks=self.sinks, recent=self.recent)
