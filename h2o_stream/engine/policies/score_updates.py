"""How a policy's scores take in the attention a forward gave its entries, by the accumulation its `Scores`
declares: the update of the scores (`EvictionPolicy.update_scores`), a chunk's query weights (`query_weights`) and
the draws of Gumbel-regularised scores (`gumbel_draws`, which the layer calls); base.py's methods call the others.
Tensor functions: torch is imported where it is used (the registry loads this module without it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from ..memo import memoised


def update_scores(policy, scores: torch.Tensor, received: torch.Tensor, steps: int) -> None:
    """`policy.update_scores`: fold what each entry `received` into its `scores`, in place."""
    accumulate = policy.scoring.accumulate
    if accumulate == "latest":
        scores.copy_(received)  # only the current query's attention counts
    elif accumulate == "window":  # received: one column per query, the forward's last ones (oldest first)
        arrived = received.shape[-1]
        if arrived >= scores.shape[-1]:
            scores.copy_(received[..., -scores.shape[-1] :])
        else:  # the window moves on by the forward's queries
            _move_window(scores, received)
    elif accumulate == "decay":
        scores.mul_(policy.decay**steps).add_(received)  # `steps` decays, as many steps would
    else:
        scores += received


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


def query_weights(policy, length: int) -> torch.Tensor | None:
    """`policy.query_weights`: decay ** (length - 1 - i) for query i of a chunk of "decay" scores, else None."""
    if policy.scoring is None or policy.scoring.accumulate != "decay":
        return None
    return _decays(policy.decay, length)


@memoised(32)
def _decays(alpha: float, length: int) -> torch.Tensor:
    """Query i's weight in a chunk of `length`: its attention is decayed by the length - 1 - i steps after it.
    Memoised (every layer of every chunk asks for the same); never modify the result."""
    import torch

    return alpha ** torch.arange(length - 1, -1, -1, dtype=torch.float64)


def gumbel_draws(
    policy, layer: int, queries: torch.Tensor, keys: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """What Gumbel-regularised scores need in one forward of layer `layer`: the noise (batch, kv_heads, group, q_len,
    k_len) and each query's temperature (q_len,), for `queries` (q_len,) and `keys` (batch, kv_heads, k_len) given as
    stream indices, from the policy's Gumbel settings (engine/draws.py)."""
    from ..draws import gumbel_noise, temperatures

    noise = gumbel_noise(policy.gumbel_seed, layer, group, queries, keys, dtype)
    return noise, temperatures(policy.tau_init, policy.tau_end, policy.tau_steps, queries).to(keys.device)
