"""The draws of Gumbel-regularised scores (`gumbel_draws`, which the layer calls); how scores take in what they
receive is scoring.py's. torch is imported where it is used (the registry loads this module without it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def gumbel_draws(
    policy, layer: int, queries: torch.Tensor, keys: torch.Tensor, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """What Gumbel-regularised scores need in one forward of layer `layer`: the noise (batch, kv_heads, group, q_len,
    k_len) and each query's temperature (q_len,), for `queries` (q_len,) and `keys` (batch, kv_heads, k_len) given as
    stream indices, from the policy's Gumbel settings (engine/draws.py)."""
    from ..draws import gumbel_noise, temperatures

    noise = gumbel_noise(policy.gumbel_seed, layer, group, queries, keys, dtype)
    return noise, temperatures(policy.tau_init, policy.tau_end, policy.tau_steps, queries).to(keys.device)
