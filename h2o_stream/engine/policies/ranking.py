"""The rankings a policy can declare (`EvictionPolicy.ranking`), on tensors: each gives the entries between the sinks
and the recent window a rank, and a cut keeps the highest (`keep_top`; ties to the older entry).

- "score": the score (attention accumulated as the policy's `Scores` say; "window" scores summed over their queries);
- "mean": RoCo's: the score over the entry's age (sum and sum of squares: `Scores("moments")`); the policy's
  `volatile` entries of highest variance ranked above every mean;
- "key_diversity": KeyDiff's: least cosine similarity to the mean unit key of everything the KV head holds;
- "token_class": SepLLM's: tokens in the policy's `separator_ids` above the rest, newer above older within each;
- "pooled": SnapKV's: the score (summed over a "window" score's queries) pooled over neighbouring slots, a window of
  the policy's `kernel` slots centred on each (average, the padding counted as 0; or the maximum with `max_pool`);
- "head_class": per KV head, as the policy's `retrieval_heads` class it in the model layer `layer`: a retrieval
  head's entries by score, a streaming head's by age (the newest highest: it keeps the sinks and its newest entries).

("age" ranks nothing: such a policy keeps its sinks and recent window, a band.) Each function takes the policy, the
layer's `positions`, `scores` and, as the ranking needs them, `keys` or `tokens`, all (batch, kv_heads, n, ...), and
returns the ranks of slots sinks .. n - recent - 1: (batch, kv_heads, n - sinks - recent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the policy registry loads this module without it
    import torch

from ..memo import memoised
from ..switch import compiled_part
from .slots import ages, keep_top, top_slots


def by_score(policy, positions, scores, **_):
    total = scores.sum(-1) if policy.score_window else scores  # "window": what the latest queries gave, summed
    return total[..., policy.protected_sinks : positions.shape[-1] - policy.protected_recent]


def by_mean(policy, positions, scores, **_):
    # The volatile ranked above every mean: keeping the top volatile + heavy of this order keeps the volatile and,
    # among the rest, the highest means, from one ranking (in exact mode it drops one entry without a sort).
    start, stop = policy.protected_sinks, positions.shape[-1] - policy.protected_recent
    age = ages(positions)[..., start:stop].to(scores.dtype)
    mean = scores[..., start:stop, 0] / age
    variance = scores[..., start:stop, 1] / age - mean.square()
    volatile = getattr(policy, "volatile", 0)
    if not volatile:
        return mean
    return mean.scatter(-1, top_slots(variance, volatile, in_slot_order=False), float("inf"))


def by_key_diversity(policy, positions, scores, *, keys, **_):
    return -anchor_similarity(keys)[..., policy.protected_sinks : positions.shape[-1] - policy.protected_recent]


def by_token_class(policy, positions, scores, *, tokens, **_):
    import torch

    n = positions.shape[-1]
    middle = tokens[..., policy.protected_sinks : n - policy.protected_recent]
    is_separator = torch.isin(middle, _id_tensor(policy.separator_ids, middle.device))
    # separators above the rest, newer above older within each: (is separator, slot) as one number
    return is_separator.long() * n + torch.arange(middle.shape[-1], device=middle.device)


def by_pooled(policy, positions, scores, **_):
    import torch.nn.functional as F

    total = scores.sum(-1) if policy.score_window else scores
    middle = total[..., policy.protected_sinks : positions.shape[-1] - policy.protected_recent]
    batch, heads, m = middle.shape
    rows = middle.reshape(batch * heads, 1, m)
    kernel = policy.kernel
    if policy.max_pool:
        pooled = F.max_pool1d(rows, kernel, stride=1, padding=kernel // 2)
    else:
        pooled = F.avg_pool1d(rows, kernel, stride=1, padding=kernel // 2)
    return pooled.view(batch, heads, m)


def by_head_class(policy, positions, scores, *, layer, **_):
    import torch

    middle = scores[..., policy.protected_sinks : positions.shape[-1] - policy.protected_recent]
    retrieval = policy.retrieval_in(layer)
    if len(retrieval) == middle.shape[1]:
        return middle
    # a streaming head ranks by slot (= stream order): its newest entries are its highest
    ranks = torch.arange(middle.shape[-1], device=middle.device, dtype=middle.dtype).expand_as(middle)
    if not retrieval:
        return ranks
    heads = torch.zeros(middle.shape[1], dtype=torch.bool, device=middle.device)
    heads[list(retrieval)] = True
    return torch.where(heads.view(1, -1, 1), middle, ranks)


#: ranking name -> ranker(policy, positions, scores, **extra) -> ranks; each takes the extras its ranking needs
RANKERS: dict[str, Callable[..., torch.Tensor]] = {
    "score": by_score,
    "mean": by_mean,
    "key_diversity": by_key_diversity,
    "token_class": by_token_class,
    "pooled": by_pooled,
    "head_class": by_head_class,
}


@memoised(8)
def _id_tensor(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(ids, dtype=torch.long, device=device)


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

    Two small products instead of normalising every key: a cut runs per layer and block, and normalising and
    `cosine_similarity` made it ten times h2o's."""
    import torch

    anchor = torch.matmul(weights.unsqueeze(-2), keys)  # (batch, heads, 1, dim)
    return torch.matmul(keys, anchor.transpose(-1, -2)).squeeze(-1) * inverse_norms


def anchor_similarity(keys: torch.Tensor) -> torch.Tensor:
    """Every key's (batch, heads, n, dim) similarity to the sum of the unit-normalised keys (n times kvpress's
    anchor, their mean): (batch, heads, n), the cosine's order; see `similarity_to`."""
    keys, inverse_norms = unit_weights(keys)
    return similarity_to(keys, inverse_norms, inverse_norms)


def key_diversity_twice(first, then, positions, scores, *, keys, **_):
    """Both cuts of a fair chunk for "key_diversity" (`EvictionPolicy.keep_twice`) from one pass over the keys: the
    second cut's anchor is the sum of the unit keys the first cut keeps (their inverse norms as weights, 0 for the
    dropped), and it ranks among the entries between the sinks and its own, shorter, recent window, the dropped ones
    last. The same slots as cutting twice; None where the reduction gave up sinks (cut twice then)."""
    import torch

    sinks, recent = first.protected_sinks, first.protected_recent
    if then.protected_sinks != sinks or then.protected_recent > recent:
        return None
    n = positions.shape[-1]
    keys, inverse_norms = unit_weights(keys)
    similarity = similarity_to(keys, inverse_norms, inverse_norms)
    kept_first = keep_top(-similarity[..., sinks : n - recent], first.ranked_slots, sinks=sinks, recent=recent)
    kept = torch.zeros(inverse_norms.shape, dtype=torch.bool, device=keys.device).scatter_(-1, kept_first, True)
    similarity = similarity_to(keys, inverse_norms, inverse_norms * kept)
    # The first cut keeps the last `recent` >= then's entries, so `then`'s window is the last slots here too.
    ranks = (-similarity).masked_fill_(~kept, float("-inf"))[..., sinks : n - then.protected_recent]
    return keep_top(ranks, then.ranked_slots, sinks=sinks, recent=then.protected_recent)


def pooled_twice(first, then, positions, scores, **_):
    """Both cuts of a fair chunk for "pooled" (`EvictionPolicy.keep_twice`) compiled (engine/compiled_cuts.py):
    the slots cutting twice keeps, or None where the tensor path runs (no numba, H2O_STREAM_COMPILED=0, scores off
    the CPU or not float64)."""
    import torch

    compiled = compiled_part("compiled_cuts")
    if compiled is None or scores.device.type != "cpu" or scores.dtype != torch.float64:
        return None
    totals = scores.sum(-1) if first.score_window else scores  # as `by_pooled` sums them
    cuts = [(p.protected_sinks, p.ranked_slots, p.protected_recent) for p in (first, then)]
    return compiled.pooled_keep_twice(totals, *cuts, first.kernel, first.max_pool)


#: ranking name -> both cuts of a fair chunk as one (first, then, positions, scores, **extra) -> slots, or None where
#: the two cuts are made one after the other (`EvictionPolicy.keep_twice`)
BOTH_CUTS: dict[str, Callable[..., torch.Tensor | None]] = {
    "key_diversity": key_diversity_twice,
    "pooled": pooled_twice,
}
