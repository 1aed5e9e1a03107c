"""Seeded draws: Gumbel noise for Gumbel-regularised scores (keyformer), one draw per (layer, query head, query, key),
and one uniform per (layer, KV head, entry) for a merge's coin (cam); the same whichever path computes them (exact
mode, fair chunks, a scanned forward, the tests' oracle), so runs repeat.

A draw is a pure function of its indices, not of a generator's state: the query's and the key's stream indices
(not their slots), the layer and the query head, and the policy's seed go through a 32-bit integer hash
(`mix`, an xorshift-multiply finaliser, products modulo 2**32), whose top 23 bits give u = (h // 2**9 + 1/2) / 2**23
in (0, 1) and the draw -log(-log(u)). docs/design.md ("keyformer") states it; the
tests' oracle computes the same numbers with Python integers.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .memo import memoised

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


def _mix_bits(x: torch.Tensor) -> torch.Tensor:
    """`mix` on an int32 tensor holding 32-bit patterns: int32 arithmetic vectorises where int64's does not (the
    largest tensor of a draw is hashed here); shifts are made logical by masking, and a product's low 32 bits are
    the same signed or unsigned."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MULTIPLIERS[0]
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MULTIPLIERS[1]
    return x ^ ((x >> 16) & 0xFFFF)


def _as_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as int32 tensors of the same 32 bits."""
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def gumbel_noise(
    seed: int, layer: int, group: int, queries: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The draws of one forward: (batch, kv_heads, group, q_len, k_len), as `dtype`.

    `queries` (q_len,) and `keys` (batch, kv_heads, k_len) are stream indices; query head h reads KV head
    h // group (transformers' repeat_kv). The draw of (query head h, query q, key k) is -log(-log(u)) with
    h' = mix(mix(head_key(seed, layer, h) ^ mix(k + salt)) ^ mix(q + salt)) and u = (h' // 2**9 + 1/2) / 2**23,
    23 bits, so that u and log(u) are exact enough in float32 (the draws lie in [-2.8, 16.6])."""
    if keys.device.type == "cpu":  # one compiled pass instead of ~40 tensor operations (most of them small)
        uniform = torch.empty(*keys.shape[:2], group, queries.shape[0], keys.shape[2], dtype=torch.float32)
        heads = _head_bits(seed, layer, keys.shape[1], group, keys.device).view(keys.shape[1], group)
        _uniforms(heads.numpy(), keys.numpy(), queries.numpy(), uniform.numpy())
    else:
        uniform = ((draw_bits(seed, layer, group, queries, keys) >> 9) & 0x7FFFFF).to(torch.float32)
        uniform.add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_().log_().neg_().to(dtype)


def draw_bits(seed: int, layer: int, group: int, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The hashes h' of `gumbel_noise`'s draws, as int32 tensors of their 32 bits: (batch, kv_heads, group, q_len,
    k_len)."""
    kv_heads = keys.shape[1]
    heads = _head_bits(seed, layer, kv_heads, group, keys.device)
    per_key = _mix_bits(heads ^ _mix_bits(_as_bits((keys + _SALT) & _MASK)).unsqueeze(2))  # (b, kv, group, k_len)
    per_query = _mix_bits(_as_bits((queries.to(keys.device) + _SALT) & _MASK))  # (q_len,)
    return _mix_bits(per_key.unsqueeze(3) ^ per_query.view(1, 1, 1, -1, 1))


@memoised(64)
def _head_bits(seed: int, layer: int, kv_heads: int, group: int, device: torch.device) -> torch.Tensor:
    """`head_key` of every query head of a layer as 32-bit patterns, (1, kv_heads, group, 1). Memoised (every
    forward of the layer asks for the same); never modify the result."""
    starts = torch.tensor([head_key(seed, layer, h) for h in range(kv_heads * group)], dtype=torch.long)
    return _as_bits(starts).view(1, kv_heads, group, 1).to(device)


@numba.njit(cache=True, boundscheck=False)
def _uniforms(heads, keys, queries, out):  # pragma: no cover (compiled; tested against draw_bits and the oracle)
    """u of every draw into `out` (batch, kv_heads, group, q_len, k_len) float32: `heads` (kv_heads, group) int32
    patterns of head_key, `keys` (batch, kv_heads, k_len) and `queries` (q_len,) stream indices. uint64 arithmetic
    masked to 32 bits (numba widens uint32 products)."""
    batch, kv_heads, k_len = keys.shape
    group, q_len = heads.shape[1], queries.shape[0]
    by_query = np.empty(q_len, np.uint64)
    by_key = np.empty(k_len, np.uint64)
    by_head_key = np.empty(k_len, np.uint64)
    for q in range(q_len):
        by_query[q] = _mix64((np.uint64(queries[q]) + np.uint64(_SALT)) & np.uint64(_MASK))
    for b in range(batch):
        for kv in range(kv_heads):
            for k in range(k_len):
                by_key[k] = _mix64((np.uint64(keys[b, kv, k]) + np.uint64(_SALT)) & np.uint64(_MASK))
            for g in range(group):
                start = np.uint64(heads[kv, g]) & np.uint64(_MASK)
                for k in range(k_len):
                    by_head_key[k] = _mix64(start ^ by_key[k])
                for q in range(q_len):
                    row = out[b, kv, g, q]
                    for k in range(k_len):
                        hashed = _mix64(by_head_key[k] ^ by_query[q])
                        row[k] = (np.float32(hashed >> np.uint64(9)) + np.float32(0.5)) * np.float32(2.0**-23)


@numba.njit(inline="always")
def _mix64(x):  # pragma: no cover (compiled)
    """`mix` on a uint64 holding 32 bits."""
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(_MULTIPLIERS[0])) & np.uint64(_MASK)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(_MULTIPLIERS[1])) & np.uint64(_MASK)
    return x ^ (x >> np.uint64(16))


def entry_uniforms(seed: int, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in (0, 1) per entry of `positions` (batch, kv_heads, n; stream indices), float64: for KV head h,
    u = (mix(head_key(seed, layer, h) ^ mix(p + salt)) // 2**9 + 1/2) / 2**23."""
    if positions.device.type == "cpu":  # one compiled pass instead of ~20 small tensor operations at every cut
        uniform = torch.empty(positions.shape, dtype=torch.float64)
        heads = _head_bits(seed, layer, positions.shape[1], 1, positions.device).view(-1)
        _entry_uniforms(heads.numpy(), positions.numpy(), uniform.numpy())
        return uniform
    return entry_uniforms_on_tensors(seed, layer, positions)


def entry_uniforms_on_tensors(seed: int, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """`entry_uniforms` with tensor operations (any device)."""
    kv_heads = positions.shape[1]
    heads = torch.tensor(
        [head_key(seed, layer, h) for h in range(kv_heads)], dtype=torch.long, device=positions.device
    ).view(1, kv_heads, 1)
    hashed = mix(heads ^ mix((positions + _SALT) & _MASK))
    return ((hashed >> 9).to(torch.float64) + 0.5) * 2.0**-23


@numba.njit(cache=True, boundscheck=False)
def _entry_uniforms(heads, positions, out):  # pragma: no cover (compiled; tested against the tensor operations)
    """u of every entry into `out` (batch, kv_heads, n) float64: `heads` (kv_heads,) int32 patterns of head_key,
    `positions` (batch, kv_heads, n) stream indices."""
    batch, kv_heads, n = positions.shape
    for b in range(batch):
        for kv in range(kv_heads):
            start = np.uint64(heads[kv]) & np.uint64(_MASK)
            for j in range(n):
                hashed = _mix64(start ^ _mix64((np.uint64(positions[b, kv, j]) + np.uint64(_SALT)) & np.uint64(_MASK)))
                out[b, kv, j] = (np.float64(hashed >> np.uint64(9)) + 0.5) * 2.0**-23


def temperatures(tau_init: float, tau_end: float, steps: int, queries: torch.Tensor) -> torch.Tensor:
    """The temperature at each query (stream index t): tau_init + (tau_end - tau_init) * min(t, steps) / steps,
    rising linearly over the first `steps` queries of the stream and then held (steps >= 1)."""
    rise = queries.to(torch.float64).clamp(max=steps) / steps
    return tau_init + (tau_end - tau_init) * rise
