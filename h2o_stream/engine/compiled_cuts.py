"""Cuts of a fair chunk compiled: the highest ranks kept where a cut drops few (`slots.keep_top`), and SnapKV's two
cuts (`EvictionPolicy.keep_twice` for the "pooled" ranking: snapkv, pyramid): the scores pooled over neighbouring
slots, the highest kept, then the same again over what the first cut kept, at the smaller budget.

On tensors a cut sorts every rank twice (a stable sort, then the kept slots back into order), and SnapKV's two cuts
take two dozen small operations per layer and chunk (slices, pooling, two cuts, gathers to carry the survivors'
scores into the second). A fair chunk's cut drops only a chunk's worth of entries, so here the lowest few are kept
in order in one pass (`_mark_lowest`), one loop per KV head. The order is the tensor path's (highest first, ties to
the older entry; NaN above everything, as torch sorts it), and the pooling adds the same scores in the same order
and divides as `avg_pool1d` does (or takes the maximum, as `max_pool1d`), so the slots kept are the tensor path's
(tests/policies/test_snapkv.py, tests/engine/test_cuts.py). CPU only. Numba compiles it on first use (cached on disk);
without numba, or with H2O_STREAM_COMPILED=0, the tensor path runs.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

_compile = numba.njit(cache=True, boundscheck=False, error_model="numpy")

FEW = 64  # the most entries a cut drops for `keep_highest` (the pass keeps that many in order)


def keep_highest(ranks: torch.Tensor, count: int, sinks: int, recent: int) -> torch.Tensor:
    """`slots.keep_top`: the first `sinks` slots, the `count` highest `ranks` (batch, kv_heads, m) among the slots
    after them, the last `recent` slots, ascending (batch, kv_heads, sinks + count + recent) int64. m - count at most
    `FEW`."""
    batch, kv_heads, m = ranks.shape
    out = np.empty((batch, kv_heads, sinks + count + recent), dtype=np.int64)
    _keep_highest(ranks.detach().contiguous().numpy(), count, sinks, recent, out)
    return torch.from_numpy(out)


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
def _keep_highest(ranks, count, sinks, recent, out):  # pragma: no cover - compiled (tests compare with tensors)
    batch, kv_heads, m = ranks.shape
    dropped = np.empty(m, dtype=np.bool_)
    for b in range(batch):
        for h in range(kv_heads):
            _mark_lowest(ranks[b, h], m - count, dropped)
            _assemble(dropped, sinks, recent, out[b, h])


@_compile
def _keep_twice(totals, sinks, ranked, recent, then_sinks, then_ranked, then_recent, kernel, max_pool, out):
    # pragma: no cover - compiled (tests compare it with the tensor path)
    batch, kv_heads, n = totals.shape
    kept_first = sinks + ranked + recent
    slots = np.empty(kept_first, dtype=np.int64)
    values = np.empty(kept_first, dtype=totals.dtype)
    second = np.empty(out.shape[2], dtype=np.int64)
    pooled = np.empty(n, dtype=totals.dtype)
    dropped = np.empty(n, dtype=np.bool_)
    for b in range(batch):
        for h in range(kv_heads):
            _keep_pooled(totals[b, h], sinks, ranked, recent, kernel, max_pool, pooled, dropped, slots)
            for i in range(kept_first):
                values[i] = totals[b, h, slots[i]]
            _keep_pooled(values, then_sinks, then_ranked, then_recent, kernel, max_pool, pooled, dropped, second)
            for i in range(out.shape[2]):
                out[b, h, i] = slots[second[i]]


@_compile
def _keep_pooled(totals, sinks, ranked, recent, kernel, max_pool, pooled, dropped, out):  # pragma: no cover
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
    _mark_lowest(pooled[:middle], middle - ranked, dropped)
    _assemble(dropped[:middle], sinks, recent, out)


@_compile
def _mark_lowest(ranks, drop, dropped):  # pragma: no cover - compiled
    """dropped[i] (len(ranks),) True for the `drop` lowest ranks, of equal ones the newer (higher i): all but the
    highest len(ranks) - drop, ties to the older. The few are kept in order (`worst`, lowest first) as the ranks go
    by."""
    m = ranks.shape[0]
    worst = np.empty(max(drop, 0), dtype=np.int64)
    held = 0
    for i in range(m if drop > 0 else 0):
        value = ranks[i]
        if held == drop:  # i is newer than every one held: it goes in unless it is above the highest held
            if _below(ranks[worst[held - 1]], value):
                continue
            held -= 1
        at = held
        while at > 0 and not _below(ranks[worst[at - 1]], value):  # after the lower ones; before equal ones
            worst[at] = worst[at - 1]
            at -= 1
        worst[at] = i
        held += 1
    dropped[:m] = False
    for k in range(held):
        dropped[worst[k]] = True


@_compile
def _below(a, b):  # pragma: no cover - compiled
    """Whether rank a sorts below rank b as torch sorts them: NaN above every number, equal NaNs equal."""
    return a < b or (b != b and a == a)


@_compile
def _assemble(dropped, sinks, recent, out):  # pragma: no cover - compiled
    """The kept slots into `out`: 0..sinks-1, the middle's slots not `dropped` (offset by sinks), the last `recent`."""
    for i in range(sinks):
        out[i] = i
    kept = sinks
    for i in range(dropped.shape[0]):
        if not dropped[i]:
            out[kept] = sinks + i
            kept += 1
    stop = sinks + dropped.shape[0]
    for i in range(recent):
        out[kept + i] = stop + i
