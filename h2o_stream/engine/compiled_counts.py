"""Scissorhands' importance counts compiled: for every key, how many query heads of its KV head gave it more than the
quantile of their attention row, per query (`attention.above_quantile` on tensors, then summed over the group).

On tensors a row's threshold takes a partial sort of every row (`topk`), a comparison of every probability and a sum
over the group: several passes over the (heads x queries x keys) probabilities and a dozen small operations per layer
and chunk. Here one loop per row finds its threshold, the value at the index `attention.threshold_index` gives, and
counts what beats it.

The threshold is found on the probabilities' bit patterns: a probability is finite and not negative (every row sees
at least its own key), and such floats order as their bit patterns do as integers. So the row's value at ascending
index k is the largest pattern t with at most k patterns below it, found bit by bit from the top, each bit one
branch-free count over the row (a sort or quickselect of the row branches on every comparison, and on fresh rows
those branches mispredict). Every few bits the row is narrowed to the patterns that can still hold t. Same numbers as
the tensor path (tests/policies/test_scissorhands.py); CPU only, float32 or float64 probabilities. Numba compiles it
on first use (cached on disk); without numba, or with H2O_STREAM_COMPILED=0, the tensor path runs
(attention.window_counts).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_compile = numba.njit(cache=True, boundscheck=False, error_model="numpy")


def counts_above(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, k_len, q_len) float32: per key and query, how many of the KV head's query heads gave the key
    more than their row's value at ascending `index` ((batch, q_len) int64, `attention.threshold_index`). `probs`
    (batch, kv_heads, group, q_len, k_len) on the CPU."""
    batch, kv_heads, _, q_len, k_len = probs.shape
    values = probs.detach().contiguous().numpy()
    patterns = values.view(np.int32 if values.dtype == np.float32 else np.int64)
    out = torch.empty(batch, kv_heads, q_len, k_len, dtype=torch.float32)
    _count(patterns, index.numpy(), values.dtype.itemsize * 8 - 2, out.numpy())
    return out.transpose(-1, -2)


@_compile
def _count(patterns, index, top_bit, out):  # pragma: no cover - compiled (tests compare it with the tensor path)
    batch, kv_heads, group, q_len, k_len = patterns.shape
    scratch = np.empty(k_len, dtype=patterns.dtype)
    for b in range(batch):
        for h in range(kv_heads):
            for q in range(q_len):
                counts = out[b, h, q]
                counts[:] = 0.0
                for g in range(group):
                    row = patterns[b, h, g, q]
                    threshold = _kth_smallest(row, index[b, q], top_bit, scratch)
                    for j in range(k_len):
                        counts[j] += row[j] > threshold


@_compile
def _kth_smallest(row, k, top_bit, scratch):  # pragma: no cover - compiled
    """The value at ascending index k of `row`, non-negative integers below 2 ** (top_bit + 1); `scratch` as long."""
    # One-element arrays hold the prefix in the row's own integer type: a Python int would widen every comparison
    # of an int32 row to int64, half as many per vector instruction.
    prefix = scratch[:1].copy()
    prefix[0] = 0
    candidate = scratch[:1].copy()
    n = row.shape[0]
    for j in range(n):
        scratch[j] = row[j]
    for bit in range(top_bit, -1, -1):
        candidate[0] = prefix[0] | (1 << bit)
        bound = candidate[0]
        below = 0
        for j in range(n):
            below += scratch[j] < bound
        narrow = bit % 3 == 0  # narrowing is a pass of its own: every third bit
        if below <= k:  # the value is at least `bound`: what is below it no longer counts
            prefix[0] = bound
            if narrow and below > 0:
                kept = 0
                for j in range(n):
                    x = scratch[j]
                    scratch[kept] = x
                    kept += x >= bound
                n = kept
                k -= below
        elif narrow and below < n:  # the value is below `bound`: what is at or above it no longer counts
            kept = 0
            for j in range(n):
                x = scratch[j]
                scratch[kept] = x
                kept += x < bound
            n = kept
    return prefix[0]
