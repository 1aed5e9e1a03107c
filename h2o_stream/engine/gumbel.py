"""Seeded Gumbel noise for Gumbel-regularised scores (Keyformer): one draw per (layer, query head, query, key), the
same whichever path computes it (exact mode, fair chunks, a scanned forward, the tests' oracle), so runs repeat.

A draw is a pure function of its indices, not of a generator's state: the query's and the key's stream indices
(not their slots), the layer and the query head, and the policy's seed go through a 32-bit integer hash
(`mix`, an xorshift-multiply finaliser with multipliers below 2**31, so every product fits an int64 exactly), which
gives u = (h + 1/2) / 2**32 in (0, 1) and the draw -log(-log(u)). docs/design.md ("keyformer") states it; the
tests' oracle computes the same numbers with Python integers.
"""

from __future__ import annotations

import torch

_MASK = 0xFFFFFFFF
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)  # odd, below 2**31
#: the stream index a query or key is hashed at is offset by this odd constant first (index 0 is not a fixed point)
_SALT = 0x9E3779B1 & 0x7FFFFFFF


def mix(x):
    """The 32-bit hash of x (an int or an int64 tensor of values in [0, 2**32)): x ^= x >> 16; x *= a; x ^= x >> 15;
    x *= b; x ^= x >> 16, the products taken modulo 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _MASK
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK
    return x ^ (x >> 16)


def head_key(seed: int, layer: int, head: int) -> int:
    """The hash a layer's query head starts from: mix(mix(mix(seed) ^ layer) ^ head)."""
    return mix(mix(mix(seed & _MASK) ^ layer) ^ head)


def gumbel_noise(seed: int, layer: int, group: int, queries: torch.Tensor, keys: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """The draws of one forward: (batch, kv_heads, group, q_len, k_len), as `dtype`.

    `queries` (q_len,) and `keys` (batch, kv_heads, k_len) are stream indices; query head h reads KV head
    h // group (transformers' repeat_kv). The draw of (query head h, query q, key k) is -log(-log(u)) with
    u = (mix(mix(head_key(seed, layer, h) ^ mix(k + salt)) ^ mix(q + salt)) + 1/2) / 2**32."""
    batch, kv_heads, k_len = keys.shape
    heads = torch.tensor([head_key(seed, layer, h) for h in range(kv_heads * group)], dtype=torch.long,
                         device=keys.device).view(1, kv_heads, group, 1)
    per_key = mix(heads ^ mix((keys + _SALT) & _MASK).unsqueeze(2))  # (batch, kv_heads, group, k_len)
    per_query = mix((queries.to(keys.device) + _SALT) & _MASK)  # (q_len,)
    hashed = mix(per_key.unsqueeze(3) ^ per_query.view(1, 1, 1, -1, 1))
    # float64: u reaches 1 - 2**-33, where -log(u) is 1.2e-10 (float32 would round u to 1 and the draw to inf)
    uniform = hashed.to(torch.float64).add_(0.5).mul_(2.0 ** -32)
    return uniform.log_().neg_().log_().neg_().to(dtype)


def temperatures(tau_init: float, tau_end: float, steps: int, queries: torch.Tensor) -> torch.Tensor:
    """The temperature at each query (stream index t): tau_init + (tau_end - tau_init) * min(t, steps) / steps,
    rising linearly over the first `steps` queries of the stream and then held (steps >= 1)."""
    rise = queries.to(torch.float64).clamp(max=steps) / steps
    return tau_init + (tau_end - tau_init) * rise
