"""How the attention an entry receives becomes its score: one object per accumulation a policy's `Scores` can
declare, which the engine asks — the shape a score takes, which queries of a forward count, what entries received
from a forward's attention probabilities, the update of the scores in place, a chunk's query weights and the factor
old scores decay by. No code outside these classes compares accumulations. Tensor functions: torch is imported where
it is used (the registry loads this module without it).

- `SUM`: score += received (H2O);
- `DECAY`: score = decay * score + received (A2SF);
- `LATEST`: score = received, the current query's alone (TOVA); in a chunk only its last query counts;
- `MOMENTS`: the sum and the sum of squares of what each step gave, a last axis of 2 (RoCo's mean and variance);
- `WINDOW`: what each of the last `window` queries gave, a last axis of `window` (oldest first) (SnapKV).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

from ..memo import memoised


class Accumulation:
    """How received attention folds into an entry's score (see the module docstring)."""

    #: the name `Scores(accumulate=...)` declares it by
    name: ClassVar[str]
    #: whether only the last query of a forward counts
    last_query_only: ClassVar[bool] = False
    #: whether scores also sum the squares of what each query gave (a last axis of 2)
    squares: ClassVar[bool] = False
    #: whether scores keep one column per query of a window (a last axis of the window's length)
    windowed: ClassVar[bool] = False
    #: whether old scores decay at each step
    decays: ClassVar[bool] = False

    def refusal(self, scores) -> str | None:
        """Why the declaration `scores` (a `Scores`) cannot accumulate this way, or None."""
        if (self.squares or self.windowed) and scores.heads != "kv":
            return f"{self.name} scores (sums of squares, per-query windows) need per-KV-head scores (heads='kv')"
        if self.windowed and not scores.window:
            return "window scores need the window's length (a number or a setting's name)"
        if scores.quantile and (not self.windowed or scores.gumbel):
            return "counts above a quantile are window scores of the model's own attention"
        return None

    def received(self, policy, probs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """What each entry received from a forward's attention `probs` (batch, kv_heads, group, q_len, k_len; the
        model's own, or Gumbel-regularised), in the shape `update` folds in, per KV head or the layer's mean as the
        policy's `score_heads` says; `mask` is the forward's mask (batch, 1, q_len, k_len; None: every key)."""
        return self.over_heads(policy, self.gathered(policy, probs, mask), probs.shape[1] * probs.shape[2])

    def gathered(self, policy, probs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """What each entry received per KV head, its query heads and the counted queries summed: (batch, kv_heads,
        k_len), with the trailing axis of the score's shape where it has one."""
        return probs.sum(dim=(2, 3))

    @staticmethod
    def over_heads(policy, received: torch.Tensor, q_heads: int) -> torch.Tensor:
        """Per-KV-head `received` as the policy's scores take it: as it is, or with `score_heads` "layer" the mean
        over the layer's `q_heads` query heads, the same for every KV head."""
        if policy.score_heads != "layer":
            return received
        from ..attention import layer_mean

        return layer_mean(received, q_heads)

    def update(self, policy, scores: torch.Tensor, received: torch.Tensor, steps: int) -> None:
        """Fold what each entry `received` into its `scores`, in place (`EvictionPolicy.update_scores`)."""
        scores += received

    def query_weights(self, policy, length: int) -> torch.Tensor | None:
        """Weights of a chunk's `length` queries in what an entry receives (None: each counts once)."""
        return None


class Sum(Accumulation):
    name = "sum"


class Decay(Accumulation):
    name = "decay"
    decays = True

    def update(self, policy, scores, received, steps):
        scores.mul_(policy.decay**steps).add_(received)  # `steps` decays, as many steps would

    def gathered(self, policy, probs, mask):
        import torch

        if probs.shape[-2] == 1:  # one query: its weight would be 1
            return super().gathered(policy, probs, mask)
        # (q_len,) @ (batch, kv_heads, q_len, k_len): a third of einsum's time here (it permuted the probabilities)
        weights = self.query_weights(policy, probs.shape[-2])
        return torch.matmul(weights.to(probs.dtype), probs.sum(dim=2))

    def query_weights(self, policy, length):
        # query i of a chunk is decayed by the length - 1 - i steps after it, so that a chunk leaves what its steps
        # would
        return _decays(policy.decay, length)


class Latest(Accumulation):
    name = "latest"
    last_query_only = True

    def gathered(self, policy, probs, mask):
        return probs[..., -1:, :].sum(dim=(2, 3))

    def update(self, policy, scores, received, steps):
        scores.copy_(received)  # only the current query's attention counts


class Moments(Accumulation):
    name = "moments"
    squares = True

    def gathered(self, policy, probs, mask):
        import torch

        # (batch, kv_heads, queries, k_len), widened before squaring: a variance is a difference of two close sums
        per_query = probs.sum(dim=2)
        per_query = per_query.to(torch.float32 if per_query.device.type == "mps" else torch.float64)
        return torch.stack([per_query.sum(2), per_query.square().sum(2)], dim=-1)


class Window(Accumulation):
    name = "window"
    windowed = True

    def gathered(self, policy, probs, mask):
        import torch

        from ..attention import additive_mask, window_counts

        window = policy.score_window
        observed = probs[..., -window:, :]
        if policy.score_quantile:
            if mask is not None and mask.dtype == torch.bool:
                mask = additive_mask(mask, probs.dtype)  # memoised, as the counts' row lengths are by its object
            # the mask itself where the window holds every query: the memoised row lengths are the mask's
            rows = mask if mask is None or mask.shape[-2] <= window else mask[..., -window:, :]
            # whole numbers: float32, as the layer keeps them
            return window_counts(observed, rows, policy.score_quantile)
        received = observed.sum(dim=2).transpose(-1, -2)
        return received.to(torch.float32 if probs.device.type == "mps" else torch.float64)

    def update(self, policy, scores, received, steps):
        # received: one column per query, the forward's last ones (oldest first)
        if received.shape[-1] >= scores.shape[-1]:
            scores.copy_(received[..., -scores.shape[-1] :])
        else:  # the window moves on by the forward's queries
            _move_window(scores, received)


SUM, DECAY, LATEST, MOMENTS, WINDOW = Sum(), Decay(), Latest(), Moments(), Window()
#: the accumulations by the name `Scores(accumulate=...)` declares
ACCUMULATIONS: dict[str, Accumulation] = {rule.name: rule for rule in (SUM, DECAY, LATEST, MOMENTS, WINDOW)}


def _move_window(scores: torch.Tensor, received: torch.Tensor) -> None:
    """Shift the columns of window scores (..., window) left by the `received` columns (..., arrived), in place, and
    put those last. On the CPU, contiguous scores outside autograd move as one flat array (numpy moves overlapping
    memory correctly; each row's last columns take the next row's first, which `received` then overwrites) instead
    of via a copy."""
    arrived = received.shape[-1]
    if scores.device.type == "cpu" and scores.is_contiguous() and not scores.requires_grad:
        flat = scores.numpy().reshape(-1)
        flat[:-arrived] = flat[arrived:]
    else:
        scores[..., :-arrived] = scores[..., arrived:].clone()
    scores[..., -arrived:] = received


@memoised(32)
def _decays(alpha: float, length: int) -> torch.Tensor:
    """Query i's weight in a chunk of `length`: its attention is decayed by the length - 1 - i steps after it,
    alpha ** (length - 1 - i). Memoised (every layer of every chunk asks for the same); never modify the result."""
    import torch

    return alpha ** torch.arange(length - 1, -1, -1, dtype=torch.float64)
