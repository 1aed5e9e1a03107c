"""The scoring seam every eviction policy plugs into.

A policy sees, per layer, the cache's bookkeeping after an attention step (stream positions of the entries each KV head
holds, and their accumulated attention scores when it asked for them) and answers one question: which slots survive.
Everything else (storage, rotation, gathering) belongs to the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from h2o_stream.errors import H2OStreamError


class EvictionPolicy(ABC):
    """Chooses which cache entries to keep once a layer holds more than `budget` entries per KV head."""

    name: ClassVar[str]
    #: the budget parts this policy takes (names of its constructor arguments), for `make_policy`
    parts: ClassVar[tuple[str, ...]] = ()
    #: whether the cache must accumulate the attention each entry receives (costs an explicit softmax)
    needs_scores: ClassVar[bool] = False

    @property
    @abstractmethod
    def budget(self) -> int | None:
        """Entries kept per layer and KV head between steps; None means unbounded."""

    @abstractmethod
    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """Slots to keep, shape (batch, kv_heads, budget), ascending so stream order is preserved.

        `positions` (batch, kv_heads, n) are stream indices in slot order (ascending); `scores` has the same shape
        (accumulated attention) or is None when `needs_scores` is False. Called only when n > budget.
        """

    def band(self) -> tuple[int, int] | None:
        """(sinks, recent) if every query keeps exactly the first `sinks` stream tokens and its last `recent`
        predecessors. Such policies need no decision inside a chunk, so chunked mode can equal exact mode with a
        banded mask. None for policies that decide from scores (or never evict)."""
        return None

    def describe(self) -> str:
        """How the budget splits, printed for users (e.g. 'h2o heavy=128 recent=128')."""
        fields = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{self.name}({fields})"

    def settings(self) -> dict:
        return {"policy": self.name, **vars(self)}


def check_count(name: str, value: int, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise H2OStreamError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise H2OStreamError(f"{name} must be >= {minimum}, got {value}")
    return value


def _need_size(name: str, cache_size: int | None) -> None:
    if cache_size is None:
        raise H2OStreamError(f"the {name} policy needs a cache size")


def last_slots(n: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """Slot indices n-count..n-1 broadcast to like's (batch, kv_heads) shape."""
    batch, heads = like.shape[:2]
    return torch.arange(n - count, n, device=like.device).expand(batch, heads, count)
