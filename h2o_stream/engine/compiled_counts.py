"""Scissorhands' importance counts compiled: for every key, how many query heads of its KV head gave it more than the
quantile of their attention row, per query (`attention.above_quantile` on tensors, then summed over the group).

On tensors a row's threshold takes a partial sort of every row (`topk`), a comparison of every probability and a sum
over the group: several passes over the (heads x queries x keys) probabilities and a dozen small operations per layer
and chunk. Here one loop per row selects its threshold (at the index `attention.threshold_index` gives) in a scratch
copy (a quickselect: the same value as the sorted row's, whatever the order of equal entries) and counts what beats
it. The probabilities are finite (every row sees at least its own key). Same numbers as the tensor path
(tests/test_scissorhands.py); CPU only, float32 or float64 probabilities. Numba compiles it on first use (cached on
disk); without numba, or with H2O_STREAM_COMPILED=0, the tensor path runs (attention.window_counts).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_compile = numba.njit(cache=True, boundscheck=False, error_model="numpy")


def counts_above(probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, k_len, q_len) float64: per key and query, how many of the KV head's query heads gave the key
    more than their row's value at ascending `index` ((batch, q_len) int64, `attention.threshold_index`). `probs`
    (batch, kv_heads, group, q_len, k_len) on the CPU."""
    batch, kv_heads, _, q_len, k_len = probs.shape
    out = np.zeros((batch, kv_heads, k_len, q_len), dtype=np.float64)
    _count(probs.detach().numpy(), index.numpy(), out)
    return torch.from_numpy(out)


@_compile
def _count(probs, index, out):  # pragma: no cover - compiled (tests compare it with the tensor path)
    batch, kv_heads, group, q_len, k_len = probs.shape
    row = np.empty(k_len, dtype=probs.dtype)
    for b in range(batch):
        for q in range(q_len):
            for h in range(kv_heads):
                for g in range(group):
                    given = probs[b, h, g, q]
                    for j in range(k_len):
                        row[j] = given[j]
                    threshold = _select(row, index[b, q])
                    for j in range(k_len):
                        if given[j] > threshold:
                            out[b, h, j, q] += 1.0


@_compile
def _select(row, k):  # pragma: no cover - compiled
    """The k-th smallest value of `row` (reordered in place): Hoare partitions around the middle entry."""
    lo, hi = 0, row.shape[0] - 1
    while lo < hi:
        pivot = row[(lo + hi) >> 1]
        i, j = lo, hi
        while i <= j:
            while i <= hi and row[i] < pivot:
                i += 1
            while j >= lo and row[j] > pivot:
                j -= 1
            if i <= j:
                row[i], row[j] = row[j], row[i]
                i += 1
                j -= 1
        if k <= j:
            hi = j
        elif k >= i:
            lo = i
        else:  # between the two parts: every entry there equals the pivot
            return row[k]
    return row[k]
