"""Exact mode compiled: one call per layer and forward makes every one-token step of it (append, attend, score, cut).

Exact mode on the tensor operations costs ~30 small operations per layer and token (append, re-rotation, attention
with scores, the cut's ranking and gathers) against the raw decode step's three, and a scanned exact forward makes
them 256 times per layer. Here one compiled loop does what `StreamingLayer` and `attend` do, step by step,
for a policy that declares how its one-entry cut is made (`EvictionPolicy.drop_one`): the new entry is appended
(un-rotated from its slot when rolling), keys are rotated to their slots (only those whose slot changed since the last
step), each query head attends over the `n + 1` entries (probabilities in float32, as `attend`), the
probabilities received become scores (summed over the query heads of a KV head, or the layer's mean; accumulated,
decayed or replaced; for roco with their squares) and, holding budget + 1, the layer drops one entry and closes the
gap. Exact-mode `ppl` and decoding run several times faster so (eval/results/speed/).

It runs on the CPU in float32 or float64 with gradients off; the same numbers as the tensor path up to float rounding
(tested against it and against the oracle, tests/engine/test_compiled.py). Numba compiles it on first use (then
cached on disk); without numba, or with H2O_STREAM_COMPILED=0, exact mode runs on the tensor operations.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

#: float reassociation (vectorised dot products) and fused multiply-adds; no assumptions about NaN or infinities
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_compile = numba.njit(cache=True, fastmath=_FASTMATH, boundscheck=False, error_model="numpy")


@dataclass
class Workspace:
    """A layer's storage for the compiled loop: keys, values, positions and scores (with their squares, for a policy
    ranking by mean) with room for budget + 1 entries (the layer's tensors are views of their first `held` slots),
    keys rotated to their slots, and how many leading slots of those are current per (row, KV head)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    scores: torch.Tensor  # (batch, kv_heads, capacity, moments): moments 1, or 2 with the squares
    rotated: torch.Tensor
    current: torch.Tensor
    views: tuple = field(default=(), init=False)  # what `hand_out` last gave the layer
    arrays: tuple = field(default=(), init=False)  # numpy views of the six above, made once

    def __post_init__(self):
        self.arrays = tuple(
            t.numpy() for t in (self.keys, self.values, self.positions, self.scores, self.rotated, self.current)
        )

    @classmethod
    def around(cls, keys, values, positions, scores, capacity: int, moments: tuple[int, ...]) -> Workspace:
        """A workspace holding copies of the given entries (scores None: the policy keeps none; `moments` their
        trailing shape, as `EvictionPolicy.score_moments`)."""
        batch, heads, held, dim = keys.shape
        room = (batch, heads, capacity)
        space = cls(
            keys.new_empty(*room, dim),
            values.new_empty(*room, values.shape[-1]),
            positions.new_empty(room),
            torch.zeros(*room, *(moments or (1,)), dtype=torch.float64),
            keys.new_empty(*room, dim),
            torch.zeros(batch, heads, dtype=torch.long),
        )
        space.keys[:, :, :held] = keys
        space.values[:, :, :held] = values
        space.positions[:, :, :held] = positions
        if scores is not None:
            space.scores[:, :, :held] = scores.reshape(space.scores[:, :, :held].shape)
        return space

    def holds(self, keys: torch.Tensor) -> bool:
        """Whether the layer's keys are this workspace's view (nothing else has replaced them since)."""
        if not (self.views and self.views[0] is keys):
            return False
        if self.arrays[0].ctypes.data != self.keys.data_ptr():  # copied (deepcopy): numpy views copy apart
            self.__post_init__()
        return True

    def hand_out(self, held: int, with_scores: bool) -> tuple:
        """Views of the first `held` slots: (keys, values, positions, scores or None); remembered for `holds`."""
        scores = self.scores[:, :, :held]
        self.views = (
            self.keys[:, :, :held],
            self.values[:, :, :held],
            self.positions[:, :, :held],
            (scores if scores.shape[-1] == 2 else scores[..., 0]) if with_scores else None,
        )
        return self.views


def exact_steps(
    space: Workspace,
    held: int,
    query,
    keys,
    values,
    tables,
    *,
    scaling: float,
    seen: int,
    budget: int,
    rule,
    layer_mean: bool,
) -> tuple[torch.Tensor, int, int, int]:
    """Run the forward's tokens one step each over `space` (holding `held` entries, at most `budget`).

    `query` (batch, q_heads, L, dim), `keys`/`values` (batch, kv_heads, L, dim) as the model made them (keys rotated
    at their slots when rolling), `tables` the roller's (cos, sin_rh, ucos, usin_rh) for slots 0..budget or None
    without rolling; `rule` the policy's `DropOne`. Returns (attention output (batch, L, q_heads, dim), entries held
    after, entries dropped over all rows and heads, the most keys a query saw)."""
    batch, q_heads, length, dim = query.shape
    out = query.new_empty(batch, length, q_heads, values.shape[-1])
    # attention probabilities as the tensor path has them: float32 where they become scores (attend),
    # else in the model's dtype (scaled_dot_product_attention)
    probs = np.empty((q_heads, space.keys.shape[2]), dtype=np.float32 if rule.ranked else space.arrays[0].dtype)
    if tables is None:
        cos = sin_rh = ucos = usin_rh = _NO_TABLE
    else:
        cos, sin_rh, ucos, usin_rh = (t.numpy() for t in tables)
    held, dropped, most = _run_loop(
        query.contiguous().numpy(),
        keys.contiguous().numpy(),
        values.contiguous().numpy(),
        *space.arrays,
        out.numpy(),
        probs,
        cos,
        sin_rh,
        ucos,
        usin_rh,
        tables is not None,
        held,
        seen,
        budget,
        scaling,
        rule.sinks,
        rule.recent,
        rule.ranked,
        rule.decay,
        rule.latest_only,
        rule.volatile if rule.by_mean else -1,
        layer_mean,
    )
    return out, held, dropped, most


_NO_TABLE = np.zeros((1, 0), dtype=np.float32)


def _run_loop(*args):
    """`_exact_steps(*args)`, recovering once from a damaged cache on disk: numba keeps the compiled loop in an index
    and data files beside the module (or under NUMBA_CACHE_DIR), and a garbage, truncated or emptied file there fails
    every later load (an UnpicklingError, EOFError, an LLVM error). The index is cleared, the loop compiled afresh
    and the new one cached, with one warning; an error that comes back after that is the loop's own and is raised."""
    global _cache_cleared
    try:
        return _exact_steps(*args)
    except Exception as error:
        if _cache_cleared:
            raise
        _cache_cleared = True
        _clear_cache()
        result = _exact_steps(*args)
        # one line, not pointing into this module: the damage is the disk's, not the caller's code
        warnings.warn_explicit(
            f"the compiled exact-mode loop's cache on disk could not be read "
            f"({type(error).__name__}: {str(error)[:120]}); it was cleared and the loop compiled "
            "afresh",
            RuntimeWarning,
            filename="h2o-stream",
            lineno=0,
        )
        return result


_cache_cleared = False  # one recovery per process: a second failure is not the cache's


def _clear_cache() -> None:
    """Empty the loop's index on disk (its data files are then never read), or stop caching where it cannot be
    written."""
    # `_cache` is private to numba's Dispatcher: its stubs (numba/core/dispatcher.pyi) leave it out
    try:
        _exact_steps._cache.flush()  # type: ignore[attr-defined]  # private, not in numba's stubs (above)
    except OSError:
        from numba.core.caching import NullCache

        _exact_steps._cache = NullCache()  # type: ignore[attr-defined]  # private, not in numba's stubs (above)


@numba.njit(inline="always", fastmath=_FASTMATH)  # a call per key, not inlined, doubled the step's time
def _rotate(dst, src, cos, sin_rh, rotary: int, dim: int) -> None:
    """dst = src * cos + roll(src, rotary / 2) * sin_rh on the first `rotary` dims (in float32, as
    rope_rolling._apply), the rest copied."""
    half = rotary // 2
    for i in range(half):
        dst[i] = np.float32(src[i]) * cos[i] + np.float32(src[i + half]) * sin_rh[i]
        dst[i + half] = np.float32(src[i + half]) * cos[i + half] + np.float32(src[i]) * sin_rh[i + half]
    for i in range(rotary, dim):
        dst[i] = src[i]


@numba.njit(inline="always", fastmath=_FASTMATH)
def _lowest(ranks, start: int, stop: int, skip) -> int:
    """The slot of the lowest of ranks[start:stop] not in `skip` (of equal lowest, the newest), or -1."""
    drop = -1
    for j in range(start, stop):
        if not skip[j] and (drop < 0 or ranks[j] <= ranks[drop]):
            drop = j
    return drop


@numba.njit(inline="always", fastmath=_FASTMATH)
def _drop_by_mean(scores, positions, n: int, stop: int, volatile: int, mean, variance, skip) -> int:
    """roco's one-entry cut among slots 0..stop-1: of those not among the `volatile` of highest variance (of equal
    variance, the older), the lowest mean attention (of equal lowest, the newest). Means and variances over each
    entry's age, as RoCoPolicy.keep computes them."""
    for j in range(stop):
        age = np.float64(positions[n - 1] - positions[j] + 1)
        mean[j] = scores[j, 0] / age
        variance[j] = scores[j, 1] / age - mean[j] * mean[j]
        skip[j] = False
    while True:  # the lowest mean that is not volatile; in practice the first candidate
        drop = _lowest(mean, 0, stop, skip)
        above = 0  # entries ranked above it by variance (higher, or equal and older)
        for k in range(stop):
            if variance[k] > variance[drop] or (variance[k] == variance[drop] and k < drop):
                above += 1
        if above >= volatile:
            return drop
        skip[drop] = True


@_compile
def _exact_steps(
    query,
    new_keys,
    new_values,
    keys,
    values,
    positions,
    scores,
    rotated,
    current,
    out,
    probs,
    cos,
    sin_rh,
    ucos,
    usin_rh,
    rolling,
    held,
    seen,
    budget,
    scaling,
    sinks,
    recent,
    ranked,
    decay,
    latest_only,
    volatile,
    layer_mean,
):
    """The compiled loop (see `exact_steps` for the arguments and the module docstring; `volatile` >= 0: rank by
    mean with roco's protected volatile entries); returns (entries held after, entries dropped, the most keys a
    query saw)."""
    batch, q_heads, length, dim = query.shape
    kv_heads, capacity, width = keys.shape[1], keys.shape[2], values.shape[-1]
    group = q_heads // kv_heads
    rotary = cos.shape[1]
    n = held
    dropped = 0
    most = 0
    received = np.empty((kv_heads, capacity), dtype=np.float32)
    scaled = np.empty(dim, dtype=query.dtype)
    summed = np.empty((group, width), dtype=values.dtype)
    mean = np.empty(capacity, dtype=np.float64)
    variance = np.empty(capacity, dtype=np.float64)
    skip = np.zeros(capacity, dtype=np.bool_)
    for t in range(length):
        slot = n
        for b in range(batch):
            for h in range(kv_heads):
                if rolling:
                    _rotate(keys[b, h, slot], new_keys[b, h, t], ucos[slot], usin_rh[slot], rotary, dim)
                else:
                    for i in range(dim):
                        keys[b, h, slot, i] = new_keys[b, h, t, i]
                for i in range(width):
                    values[b, h, slot, i] = new_values[b, h, t, i]
                positions[b, h, slot] = seen + t
                if ranked:
                    for m in range(scores.shape[3]):
                        scores[b, h, slot, m] = 0.0
        n += 1
        most = max(most, n)
        for b in range(batch):
            for h in range(kv_heads):
                # keys whose slot changed since they were last rotated (a cut renumbers those after it)
                for j in range(current[b, h], n):
                    if rolling:
                        _rotate(rotated[b, h, j], keys[b, h, j], cos[j], sin_rh[j], rotary, dim)
                    else:
                        for i in range(dim):
                            rotated[b, h, j, i] = keys[b, h, j, i]
                current[b, h] = n
                for g in range(group):
                    head = h * group + g
                    for i in range(dim):
                        scaled[i] = query[b, head, t, i] * scaling
                    for j in range(n):
                        logit = scaled[0] * 0
                        for i in range(dim):
                            logit += scaled[i] * rotated[b, h, j, i]
                        probs[head, j] = logit
                    top = probs[head, 0]
                    for j in range(1, n):
                        top = max(top, probs[head, j])
                    total = top * 0
                    for j in range(n):
                        probs[head, j] = math.exp(probs[head, j] - top)
                        total += probs[head, j]
                    inverse = 1 / total
                    for j in range(n):
                        probs[head, j] *= inverse
                summed[:, :] = 0.0
                for j in range(n):
                    for g in range(group):
                        p = probs[h * group + g, j]
                        for i in range(width):
                            summed[g, i] += p * values[b, h, j, i]
                for g in range(group):
                    for i in range(width):
                        out[b, t, h * group + g, i] = summed[g, i]
            if ranked:
                for h in range(kv_heads):
                    for j in range(n):
                        s = probs[h * group, j]
                        for g in range(1, group):
                            s += probs[h * group + g, j]
                        received[h, j] = s
                if layer_mean:
                    for j in range(n):
                        s = received[0, j]
                        for h in range(1, kv_heads):
                            s += received[h, j]
                        s = s / np.float32(q_heads)
                        for h in range(kv_heads):
                            received[h, j] = s
                for h in range(kv_heads):
                    for j in range(n):
                        if latest_only:
                            scores[b, h, j, 0] = received[h, j]
                        elif volatile >= 0:  # and the square of what this step gave, for the variance
                            gave = np.float64(received[h, j])
                            scores[b, h, j, 0] += gave
                            scores[b, h, j, 1] += gave * gave
                        elif decay != 1.0:
                            scores[b, h, j, 0] = scores[b, h, j, 0] * decay + received[h, j]
                        else:
                            scores[b, h, j, 0] += received[h, j]
            if n <= budget:
                continue
            for h in range(kv_heads):
                if not ranked:  # the oldest entry past the sinks
                    drop = sinks
                elif volatile >= 0:
                    drop = _drop_by_mean(scores[b, h], positions[b, h], n, n - recent, volatile, mean, variance, skip)
                else:  # the lowest score; of equal lowest, the newest
                    drop = _lowest(scores[b, h, :, 0], sinks, n - recent, skip)
                for j in range(drop, n - 1):
                    for i in range(dim):
                        keys[b, h, j, i] = keys[b, h, j + 1, i]
                    for i in range(width):
                        values[b, h, j, i] = values[b, h, j + 1, i]
                    positions[b, h, j] = positions[b, h, j + 1]
                    for m in range(scores.shape[3]):
                        scores[b, h, j, m] = scores[b, h, j + 1, m]
                current[b, h] = min(current[b, h], drop)
        if n > budget:
            n -= 1
            dropped += batch * kv_heads
    return n, dropped, most
