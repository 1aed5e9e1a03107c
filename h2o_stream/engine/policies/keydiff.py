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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from .base import RECENT, SINKS, EvictionPolicy, Part
from .slots import keep_top
from .registry import register


def unit_weights(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys in float64 (float32 on MPS, which has no float64), the reciprocal of every key's norm (batch, heads, n)):
    ranking in float64 does not hinge on rounding."""
    import torch
    keys = keys.to(torch.float32 if keys.device.type == "mps" else torch.float64)
    return keys, torch.linalg.vector_norm(keys, dim=-1).clamp_min(1e-12).reciprocal()


def similarity_to(keys: torch.Tensor, inverse_norms: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Every key's cosine similarity to the anchor sum_j weights_j keys_j, times the anchor's norm (the same for every
    key of a head, so the order is the cosine's): (batch, heads, n). With `weights` the inverse norms this is the sum
    of the unit keys, n times the mean: the same order as the mean's.

    Two small products instead of normalising every key: `keep` runs per layer and block, and normalising and
    `cosine_similarity` made it ten times h2o's."""
    import torch
    anchor = torch.matmul(weights.unsqueeze(-2), keys)  # (batch, heads, 1, dim)
    return torch.matmul(keys, anchor.transpose(-1, -2)).squeeze(-1) * inverse_norms


def anchor_similarity(keys: torch.Tensor) -> torch.Tensor:
    """Every key's (batch, heads, n, dim) similarity to the sum of the unit-normalised keys (n times kvpress's
    anchor, their mean): (batch, heads, n), the cosine's order; see `similarity_to`."""
    keys, inverse_norms = unit_weights(keys)
    return similarity_to(keys, inverse_norms, inverse_norms)


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

    def keep_twice(self, then: EvictionPolicy, positions: torch.Tensor, scores: torch.Tensor | None, *,
                   keys: torch.Tensor) -> torch.Tensor:
        """Both cuts from one pass over the keys: the second cut's anchor is the sum of the unit keys the first cut
        keeps (their inverse norms as weights, 0 for the dropped), and it ranks among the entries between the sinks
        and its own, shorter, recent window, the dropped ones last. The same slots as cutting twice."""
        import torch
        # A reduction that gave up sinks (or, never with `reduced`, widened the window): the plain way.
        if then.sinks != self.sinks or then.recent > self.recent:
            return super().keep_twice(then, positions, scores, keys=keys)
        n = positions.shape[-1]
        keys, inverse_norms = unit_weights(keys)
        similarity = similarity_to(keys, inverse_norms, inverse_norms)
        first = keep_top(-similarity[..., self.sinks: n - self.recent], self.diverse, sinks=self.sinks,
                         recent=self.recent)
        kept = torch.zeros(inverse_norms.shape, dtype=torch.bool, device=keys.device).scatter_(-1, first, True)
        similarity = similarity_to(keys, inverse_norms, inverse_norms * kept)
        # The first cut keeps the last `recent` >= then.recent entries, so `then`'s window is the last slots here too.
        ranks = (-similarity).masked_fill_(~kept, float("-inf"))[..., self.sinks: n - then.recent]
        return keep_top(ranks, then.diverse, sinks=self.sinks, recent=then.recent)
