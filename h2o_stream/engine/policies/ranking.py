"""How a policy ranks the entries between the sinks and the recent window: one object per ranking, which a policy
declares (`EvictionPolicy.ranking`) and the engine asks — what the ranking needs (scores, keys, values, token ids, the
layer's index; the policy fields it reads), how a cut keeps the highest ranks (`keep`; ties to the older entry),
whether two cuts in a row keep what one keeps (`nests`), both cuts of a fair chunk as one where it has such a way
(`keep_twice`) and exact mode's one-entry cut for the compiled loop (`drop_one`). No code outside these classes
compares rankings.

- `AGE`: nothing ranked: the sinks and the recent window, a band;
- `SCORE`: the score (attention accumulated as the policy's `Scores` say; "window" scores summed over their queries);
- `MEAN`: RoCo's: the score over the entry's age (sum and sum of squares: `Scores("moments")`); the policy's
  `volatile` entries of highest variance ranked above every mean;
- `KEY_DIVERSITY`: KeyDiff's: least cosine similarity to the mean unit key of everything the KV head holds;
- `TOKEN_CLASS`: SepLLM's: tokens in the policy's `separator_ids` above the rest, newer above older within each;
- `POOLED`: SnapKV's: the score (summed over a "window" score's queries) pooled over neighbouring slots, a window of
  the policy's `kernel` slots centred on each (average, the padding counted as 0; or the maximum with `max_pool`);
- `HEAD_CLASS`: per KV head, as the policy's `retrieval_heads` class it in the model layer: a retrieval head's
  entries by score, a streaming head's by age (the newest highest: it keeps the sinks and its newest entries);
- `OWN_SCORE`: the policy's own `score(entries)` (a policy that defines `score` ranks by it; `Entries`).

`ranks` takes the policy, the layer's `positions`, `scores` and, as the ranking needs them, `keys=`, `values=`,
`tokens=` or `layer=`, all (batch, kv_heads, n, ...), and returns the ranks of slots sinks .. n - recent - 1:
(batch, kv_heads, n - sinks - recent). torch is imported where it is used: the policy registry loads this module
without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

from ..memo import memoised
from ..switch import compiled_part
from .declarations import DropOne
from .slots import ages, first_slots, keep_top, last_slots, top_slots


@dataclass(frozen=True)
class Entries:
    """What a policy's `score` sees of the entries one layer holds, per row and KV head, in slot order (oldest
    first): `positions` (batch, kv_heads, n) stream indices; `keys` and `values` (batch, kv_heads, n, head_dim) as
    the layer stores them (keys un-rotated when rolling); `scores` the accumulated scores its `scoring` declares
    (None without one); `layer` the model layer's index."""

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor | None
    layer: int


class Ranking:
    """A way of ranking the entries between a policy's sinks and its recent window (see the module docstring)."""

    #: what result files, the oracle and messages call it
    name: ClassVar[str]
    #: whether it ranks at all (`AGE` does not: the policy keeps a band)
    ranks_entries: ClassVar[bool] = True
    #: whether it reads scores: the policy must declare a `scoring`
    needs_scores: ClassVar[bool] = True
    #: what the layer hands `ranks` besides positions and scores
    needs_keys: ClassVar[bool] = False
    needs_values: ClassVar[bool] = False
    needs_tokens: ClassVar[bool] = False
    needs_layer: ClassVar[bool] = False
    #: the policy fields it reads, checked when a policy class is declared
    reads: ClassVar[tuple[str, ...]] = ()

    def __repr__(self) -> str:
        return self.name.upper()

    def refusal(self, cls) -> str | None:
        """Why policy class `cls` cannot rank this way (a sentence after its name), or None."""
        if self.needs_scores and cls.scoring is None:
            return f"ranks by {self.name} and needs a scoring"
        declared = set(cls.option_names()) | set(cls.part_names())
        declared |= {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
        if not set(self.reads) <= declared:
            return f"ranks by {self.name} and needs the settings {', '.join(self.reads)}"
        return None

    def ranks(self, policy, positions: torch.Tensor, scores: torch.Tensor | None, **extra: Any) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, policy, positions: torch.Tensor, scores: torch.Tensor | None, **extra: Any) -> torch.Tensor:
        """`EvictionPolicy.keep` for this ranking: the sinks, the `ranked_slots` highest ranks, the recent window."""
        ranks = self.ranks(policy, positions, scores, **extra)
        return keep_top(ranks, policy.ranked_slots, sinks=policy.protected_sinks, recent=policy.protected_recent)

    def keep_twice(self, first, then, positions, scores, **extra: Any) -> torch.Tensor | None:
        """Both cuts of a fair chunk as one (`EvictionPolicy.keep_twice`), or None: cut twice."""
        return None

    def nests(self, policy) -> bool:
        """Whether cutting to the budget and then to a `reduced` one keeps what one cut to the reduced budget keeps
        (scores unchanged): True for one fixed order of the entries."""
        return True

    def drop_one(self, policy) -> DropOne | None:
        """Exact mode's one-entry cut as the compiled loop makes it (`DropOne`), or None: the tensor operations."""
        return None


class Age(Ranking):
    """Nothing ranked: the policy keeps its sinks and its recent window."""

    name = "age"
    ranks_entries = False
    needs_scores = False

    def keep(self, policy, positions, scores, **extra):
        import torch

        # The sinks are never cut and are the oldest entries, so past the first cut they sit in slots 0..sinks-1.
        n = positions.shape[-1]
        sinks = first_slots(policy.protected_sinks, positions)
        return torch.cat([sinks, last_slots(n, policy.protected_recent, positions)], dim=-1)

    def drop_one(self, policy):
        return DropOne(sinks=policy.protected_sinks, recent=policy.protected_recent, ranked=False)


class Score(Ranking):
    name = "score"

    def ranks(self, policy, positions, scores, **_):
        total = scores.sum(-1) if policy.score_window else scores  # "window": what the latest queries gave, summed
        return total[..., policy.protected_sinks : positions.shape[-1] - policy.protected_recent]

    def drop_one(self, policy):
        return DropOne(
            sinks=policy.protected_sinks,
            recent=policy.protected_recent,
            ranked=True,
            decay=policy.decay,
            latest_only=policy.score_queries == "last",
        )


class Mean(Ranking):
    name = "mean"

    def refusal(self, cls):
        if cls.scoring is not None and not cls.scoring.rule.squares:
            return "ranks by the mean and needs Scores('moments')"
        return super().refusal(cls)

    def ranks(self, policy, positions, scores, **_):
        # The volatile ranked above every mean: keeping the top volatile + heavy of this order keeps the volatile
        # and, among the rest, the highest means, from one ranking (in exact mode it drops one entry without a sort).
        start, stop = policy.protected_sinks, positions.shape[-1] - policy.protected_recent
        age = ages(positions)[..., start:stop].to(scores.dtype)
        mean = scores[..., start:stop, 0] / age
        variance = scores[..., start:stop, 1] / age - mean.square()
        volatile = getattr(policy, "volatile", 0)
        if not volatile:
            return mean
        return mean.scatter(-1, top_slots(variance, volatile, in_slot_order=False), float("inf"))

    def nests(self, policy):
        return policy.protected_recent >= 1  # ages count from the newest entry, which must stay

    def drop_one(self, policy):
        volatile = getattr(policy, "volatile", 0)
        return DropOne(
            sinks=policy.protected_sinks, recent=policy.protected_recent, ranked=True, by_mean=True, volatile=volatile
        )


class KeyDiversity(Ranking):
    name = "key_diversity"
    needs_scores = False
    needs_keys = True

    def ranks(self, policy, positions, scores, *, keys, **_):
        return -anchor_similarity(keys)[..., policy.protected_sinks : positions.shape[-1] - policy.protected_recent]

    def keep_twice(self, first, then, positions, scores, **extra):
        return key_diversity_twice(first, then, positions, scores, **extra)

    def nests(self, policy):
        return False  # the anchor is the mean of the keys held


class TokenClass(Ranking):
    name = "token_class"
    needs_scores = False
    needs_tokens = True
    reads = ("separator_ids",)

    def ranks(self, policy, positions, scores, *, tokens, **_):
        import torch

        n = positions.shape[-1]
        middle = tokens[..., policy.protected_sinks : n - policy.protected_recent]
        is_separator = torch.isin(middle, _id_tensor(policy.separator_ids, middle.device))
        # separators above the rest, newer above older within each: (is separator, slot) as one number
        return is_separator.long() * n + torch.arange(middle.shape[-1], device=middle.device)


class Pooled(Ranking):
    name = "pooled"
    reads = ("kernel", "max_pool")

    def ranks(self, policy, positions, scores, **_):
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

    def keep_twice(self, first, then, positions, scores, **extra):
        return pooled_twice(first, then, positions, scores, **extra)

    def nests(self, policy):
        return False  # a rank depends on the neighbours an earlier cut left


class HeadClass(Ranking):
    name = "head_class"
    needs_layer = True
    reads = ("retrieval_heads",)

    def ranks(self, policy, positions, scores, *, layer, **_):
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


class OwnScore(Ranking):
    """The policy's own `score(entries) -> (batch, kv_heads, n)` over every entry held (`Entries`); the highest of
    those between the sinks and the recent window are kept. Its scores may depend on the other entries held, so a
    fair chunk cuts twice."""

    name = "own_score"
    needs_scores = False
    needs_keys = needs_values = needs_layer = True

    def refusal(self, cls):
        if not callable(getattr(cls, "score", None)):
            return "ranks by its own score and needs a `score(entries)` method"
        return super().refusal(cls)

    def ranks(self, policy, positions, scores, *, keys, values, layer, **_):
        score = policy.score(Entries(positions, keys, values, scores, layer))
        return score[..., policy.protected_sinks : positions.shape[-1] - policy.protected_recent]

    def nests(self, policy):
        return False


AGE, SCORE, MEAN, KEY_DIVERSITY = Age(), Score(), Mean(), KeyDiversity()
TOKEN_CLASS, POOLED, HEAD_CLASS, OWN_SCORE = TokenClass(), Pooled(), HeadClass(), OwnScore()


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

    Two small products instead of normalising every key: a cut runs per layer and block, and normalising every key
    (or `cosine_similarity`) makes a copy of all of them each time."""
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
