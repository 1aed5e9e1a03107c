"""SnapKV's two cuts of a fair chunk compiled (`EvictionPolicy.keep_twice` for the "pooled" ranking: snapkv,
pyramid): the scores pooled over neighbouring slots, the highest kept, then the same again over what the first cut
kept, at the smaller budget.

On tensors the two cuts take two dozen small operations per layer and chunk (slices, pooling, two stable sorts per
cut, gathers to carry the survivors' scores into the second cut). Here one loop per KV head pools, selects and
composes. The pooling adds the same scores in the same order and divides as `avg_pool1d` does (or takes the
maximum, as `max_pool1d`), and the selection is the same order (highest first, ties to the older entry), so the slots
kept are the tensor path's (tests/test_snapkv.py). CPU only, float64 scores. Numba compiles it on first
use (cached on disk); without numba, or with H2O_STREAM_COMPILED=0, the tensor path runs.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_compile = numba.njit(cache=True, boundscheck=False, error_model="numpy")


def pooled_keep_twice(
    totals: torch.Tensor,
    first: tuple[int, int, int],
    then: tuple[int, int, int],
    kernel: int,
    max_pool: bool,
) -> torch.Tensor:
    """The slots (batch, kv_heads, kept) two cuts keep, ascending: `totals` (batch, kv_heads, n) float64, the
    scores summed over their window; each cut (sinks, ranked, recent) keeps its first `sinks` slots, the `ranked`
    highest pooled totals between them and its last `recent` slots, and those; `then` cuts what `first` kept."""
    batch, kv_heads, _ = totals.shape
    out = np.empty((batch, kv_heads, sum(then)), dtype=np.int64)
    _keep_twice(totals.detach().contiguous().numpy(), *first, *then, kernel, max_pool, out)
    return torch.from_numpy(out)


@_compile
def _keep_twice(totals, sinks, ranked, recent, then_sinks, then_ranked, then_recent, kernel, max_pool, out):
    # pragma: no cover - compiled (tests compare it with the tensor path)
    batch, kv_heads, n = totals.shape
    kept_first = sinks + ranked + recent
    slots = np.empty(kept_first, dtype=np.int64)
    values = np.empty(kept_first, dtype=totals.dtype)
    second = np.empty(out.shape[2], dtype=np.int64)
    pooled = np.empty(n, dtype=totals.dtype)
    for b in range(batch):
        for h in range(kv_heads):
            _keep(totals[b, h], sinks, ranked, recent, kernel, max_pool, pooled, slots)
            for i in range(kept_first):
                values[i] = totals[b, h, slots[i]]
            _keep(values, then_sinks, then_ranked, then_recent, kernel, max_pool, pooled, second)
            for i in range(out.shape[2]):
                out[b, h, i] = slots[second[i]]


@_compile
def _keep(totals, sinks, ranked, recent, kernel, max_pool, pooled, out):  # pragma: no cover - compiled
    """One cut of one KV head's `totals` (n,) into `out` (sinks + ranked + recent,), ascending."""
    n = totals.shape[0]
    start, stop = sinks, n - recent
    middle = stop - start
    half = kernel // 2
    for i in range(middle):  # pooled over the middle alone, padded outside it (as `ranking.by_pooled`)
        if max_pool:
            acc = -np.inf
            for j in range(max(i - half, 0), min(i + half + 1, middle)):
                value = totals[start + j]
                if value > acc or np.isnan(value):
                    acc = value
            pooled[i] = acc
        else:
            acc = 0.0
            for j in range(max(i - half, 0), min(i + half + 1, middle)):
                acc += totals[start + j]
            pooled[i] = acc / kernel
    # The `ranked` highest, ties to the older, are all but the `middle - ranked` lowest, ties to the newer: a cut
    # drops few (a fair chunk's), so those few are kept in order (`worst`, lowest first) as the middle goes by.
    drop = middle - ranked
    worst = np.empty(max(drop, 0), dtype=np.int64)
    held = 0
    for i in range(middle if drop > 0 else 0):
        value = pooled[i]
        if held == drop:  # i is newer than every one held: it goes in unless it is higher than the highest held
            if value > pooled[worst[held - 1]]:
                continue
            held -= 1
        at = held
        while at > 0 and pooled[worst[at - 1]] >= value:  # after the lower ones; before equal ones (it is newer)
            worst[at] = worst[at - 1]
            at -= 1
        worst[at] = i
        held += 1
    dropped = np.zeros(middle, dtype=np.bool_)
    for k in range(held):
        dropped[worst[k]] = True
    for i in range(sinks):
        out[i] = i
    kept = sinks
    for i in range(middle):
        if not dropped[i]:
            out[kept] = start + i
            kept += 1
    for i in range(recent):
        out[sinks + ranked + i] = stop + i
