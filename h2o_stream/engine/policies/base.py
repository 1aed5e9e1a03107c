"""The scoring seam every eviction policy plugs into.

A policy sees, per layer, the cache's bookkeeping after an attention step (stream positions of the entries each KV head
holds, and their accumulated attention scores when it asked for them) and answers one question: which slots survive.
Everything else (storage, rotation, gathering) belongs to the cache.

A policy declares its budget `parts` (each a number of cache slots, with a default and a help text); the parts add up
to the budget. `make_policy`, the command-line options, the printed split and the result files are all driven by
these declarations, so a new policy is one file in this folder with `@register` on its class.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from h2o_stream.errors import H2OStreamError


@dataclass(frozen=True)
class Part:
    """One part of a policy's budget: `name` slots of the cache (also the constructor argument and the `--name` option).

    Its default, when not given: `fixed` slots, or a `share` of the cache size (rounded down), or (neither) the rest:
    what the other parts leave of the cache size. A policy has at most one rest part.
    """

    name: str
    help: str
    fixed: int | None = None
    share: float | None = None

    def __post_init__(self):
        if not self.name.isidentifier():
            raise H2OStreamError(f"a budget part needs a name usable as an argument, got {self.name!r}")
        if self.fixed is not None and self.share is not None:
            raise H2OStreamError(f"part {self.name!r} has both a fixed and a shared default; give one")

    @property
    def is_rest(self) -> bool:
        return self.fixed is None and self.share is None

    def default(self, cache_size: int) -> int | None:
        """Slots this part takes by default out of `cache_size` (None: the rest part, decided by the others)."""
        if self.fixed is not None:
            return self.fixed
        if self.share is not None:
            return math.floor(cache_size * self.share)
        return None

    @property
    def default_text(self) -> str:
        """The default in words, for help texts."""
        if self.fixed is not None:
            return f"{self.fixed}"
        if self.share is not None:
            return "half the cache size" if self.share == 0.5 else f"{self.share:g} of the cache size"
        return "the cache size minus the other parts"


#: the recent window most policies keep; as the rest part it takes what their other parts leave
RECENT = Part("recent", "recent-window slots, the last entries")


class EvictionPolicy(ABC):
    """Chooses which cache entries to keep once a layer holds more than `budget` entries per KV head.

    Subclasses are dataclasses whose fields are their settings (usually exactly their `parts`), so that
    `type(policy)(**vars(policy))` rebuilds a policy and `settings()` identifies it in checkpoints and results.
    """

    name: ClassVar[str]
    #: the budget parts this policy takes, in the order they are printed; they add up to the budget
    parts: ClassVar[tuple[Part, ...]] = ()
    #: whether the cache must accumulate the attention each entry receives (costs an explicit softmax)
    needs_scores: ClassVar[bool] = False

    _part_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.parts, tuple) or not all(isinstance(part, Part) for part in cls.parts):
            raise H2OStreamError(f"{cls.__qualname__}.parts must be a tuple of Part declarations")
        cls._part_names = tuple(part.name for part in cls.parts)  # `budget` runs every layer and step: no rebuilding

    @classmethod
    def part_names(cls) -> tuple[str, ...]:
        """The names of the declared parts, in order."""
        return cls._part_names

    @classmethod
    def from_budget(cls, cache_size: int | None, **given: int) -> EvictionPolicy:
        """The policy for `cache_size` entries per layer and KV head, with the parts in `given` fixed.

        The parts not given take their declared defaults, in declaration order, each at most what is left; the rest
        part (or, when it was given, the last part not given) takes what remains. A policy without parts ignores the
        cache size. `make_policy` validates the values first; override this for a split the declarations cannot say.
        """
        if not cls.parts:
            return cls()
        if cache_size is None:
            raise H2OStreamError(f"the {cls.name} policy needs a cache size")
        return cls(**split_budget(cls.parts, cache_size, given))

    def __post_init__(self):
        for part in self.parts:
            check_count(part.name, getattr(self, part.name))
        if self.parts and self.budget < 1:
            raise H2OStreamError(f"{self.name} policy needs {' + '.join(self.part_names())} >= 1")

    @property
    def budget(self) -> int | None:
        """Entries kept per layer and KV head between steps (the sum of the parts); None means unbounded."""
        if not self._part_names:
            return None
        total = 0
        for name in self._part_names:
            total += getattr(self, name)
        return total

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

    def split(self) -> dict[str, int]:
        """The declared parts and their values, e.g. {'heavy': 128, 'recent': 128}."""
        return {part.name: getattr(self, part.name) for part in self.parts}

    def describe(self) -> str:
        """How the budget splits, printed for users (e.g. 'h2o(heavy=128, recent=128)')."""
        fields = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{self.name}({fields})"

    def settings(self) -> dict:
        """{'policy': name, **fields}: what checkpoints compare and result files record."""
        return {"policy": self.name, **vars(self)}


def split_budget(parts: tuple[Part, ...], cache_size: int, given: dict[str, int]) -> dict[str, int]:
    """`given` completed to every part (declaration order); see `EvictionPolicy.from_budget`."""
    values = {name: value for name, value in given.items() if value is not None}
    missing = [part for part in parts if part.name not in values]
    if missing:
        rest = next((part for part in missing if part.is_rest), missing[-1])
        left = cache_size - sum(values.values())
        if left < 0:
            shown = " + ".join(f"{k}={v}" for k, v in values.items())
            raise H2OStreamError(f"{shown} exceeds the cache size ({cache_size})")
        for part in missing:
            if part is not rest:
                values[part.name] = min(part.default(cache_size), left)
                left -= values[part.name]
        values[rest.name] = left
    return {part.name: values[part.name] for part in parts}


def check_count(name: str, value: int, *, minimum: int = 0) -> int:
    """`value` if it is an integer >= minimum, else a clear H2OStreamError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise H2OStreamError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise H2OStreamError(f"{name} must be >= {minimum}, got {value}")
    return value


def last_slots(n: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """Slot indices n-count..n-1 broadcast to like's (batch, kv_heads) shape."""
    batch, heads = like.shape[:2]
    return torch.arange(n - count, n, device=like.device).expand(batch, heads, count)
