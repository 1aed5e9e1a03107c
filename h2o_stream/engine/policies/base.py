"""The scoring seam every eviction policy plugs into.

A policy sees, per layer, the cache's bookkeeping after an attention step (stream positions of the entries each KV head
holds; when it asks for them, their scores, their keys or their token ids) and answers one question: which slots
survive. It declares how the attention an entry receives becomes its score (`update_scores`, `score_heads`,
`score_queries`) and whether it needs attention probabilities at all (`needs_scores`: those that do not keep the fused
attention path). Everything else (storage, rotation, gathering) belongs to the cache.

A policy declares its budget `parts` (each a number of cache slots, with a default and a help text); the parts add up
to the budget. `make_policy`, the command-line options, the printed split and the result files are all driven by
these declarations, so a new policy is one file in this folder with `@register` on its class.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from h2o_stream.errors import H2OStreamError

from .slots import at_slots


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
#: H2O's heavy hitters; half the cache by default, the paper's split
HEAVY = Part("heavy", "heavy-hitter slots, the highest-scored older entries", share=0.5)
#: the stream's first tokens, kept for good (StreamingLLM's attention sinks)
SINKS = Part("sinks", "attention-sink slots, the stream's first tokens", fixed=4)  # StreamingLLM's choice


@dataclass(frozen=True)
class Setting:
    """A policy setting that is not a number of slots (e.g. a2sf's forgetting factor): `name` is the constructor
    argument, `default` its value when not given. The policy's `__post_init__` checks the value."""

    name: str
    help: str
    default: float | bool

    def __post_init__(self):
        if not self.name.isidentifier():
            raise H2OStreamError(f"a policy setting needs a name usable as an argument, got {self.name!r}")


@dataclass(frozen=True)
class DropOne:
    """How a policy makes exact mode's cut of one entry (a layer holding budget + 1), declared for the compiled
    exact-mode step (`engine/compiled.py`), which must then drop what `keep` would: per KV head, the slots below
    `sinks` and the last `recent` slots are never dropped; of the others, with `ranked`, the lowest score goes (of
    equal lowest, the newest: `keep`'s ties to the older entry), else the oldest one.

    Scores, with `ranked`: a new entry starts at 0 and each step `score <- decay * score + received`, or
    `score <- received` with `latest_only` (the current query's attention alone); received per KV head or the
    layer's mean, as the policy's `score_heads` says. With `by_mean` (roco; `score_squares`) the scores also sum the
    squares of what each step gave, the rank is the mean over the entry's age, and of the candidates the `volatile`
    of highest variance (of equal variance, the older) are never dropped."""

    sinks: int
    recent: int
    ranked: bool
    decay: float = 1.0
    latest_only: bool = False
    by_mean: bool = False
    volatile: int = 0


class EvictionPolicy(ABC):
    """Chooses which cache entries to keep once a layer holds more than `budget` entries per KV head.

    Subclasses are dataclasses whose fields are their settings (usually exactly their `parts`), so that
    `type(policy)(**vars(policy))` rebuilds a policy and `settings()` identifies it in checkpoints and results.
    """

    name: ClassVar[str]
    #: the budget parts this policy takes, in the order they are printed; they add up to the budget
    parts: ClassVar[tuple[Part, ...]] = ()
    #: settings that are not slot counts, with their defaults (fields of the dataclass too)
    options: ClassVar[tuple[Setting, ...]] = ()
    #: whether the cache must keep a score from the attention each entry receives (costs an explicit softmax;
    #: policies without it keep the fused attention path, and their layers carry no scores)
    needs_scores: ClassVar[bool] = False
    #: whose attention makes an entry's score: "kv" — per KV head, the query heads reading it summed (GQA/MQA);
    #: "layer" — the mean over all query heads of the layer, the same for every KV head (one decision per layer)
    score_heads: ClassVar[str] = "kv"
    #: which queries of a forward count: "all" — every query of a chunk, summed; "last" — only its last query.
    #: Exact mode has one query per forward, so this matters only in chunked mode.
    score_queries: ClassVar[str] = "all"
    #: whether an entry's score also sums the square of each query's attention, to tell steady attention from
    #: fluctuating (RoCo's variance): the scores then gain a last axis of 2, [..., 0] the attention received and
    #: [..., 1] the sum of its squares, one square per query (per KV head: needs `score_heads` "kv")
    score_squares: ClassVar[bool] = False
    #: whether `keep` needs the keys the layer holds (passed as `keys=`)
    needs_keys: ClassVar[bool] = False
    #: whether `keep` needs the token id of every entry (passed as `tokens=`; forwards must bring token ids)
    needs_tokens: ClassVar[bool] = False
    #: whether building the policy needs the model's tokenizer (see `tokenizer_settings`)
    needs_tokenizer: ClassVar[bool] = False
    #: whether cutting to the budget and then to a `reduced` budget keeps what one cut to the reduced budget keeps
    #: (the scores unchanged in between). True when `keep` takes the top of one fixed order of the entries, apart from
    #: sinks and a recent window that only shrink when reduced (h2o, a2sf, tova, sepllm); not for keydiff, whose
    #: anchor is the mean of the keys held. Between two fair chunks (or blocks of a fair scan) such a policy then
    #: makes one cut, with `reduced`; one whose cuts do not nest makes both at once (`keep_twice`).
    cuts_nest: ClassVar[bool] = False
    #: the default chunk in fair chunked mode, as a share of the budget (`default_chunk_size`, which also keeps it
    #: within the recent window + 1): small enough that chunked perplexity stays within 1% of exact mode's (measured
    #: per policy, eval/results/quality/gap.json)
    fair_chunk_share: ClassVar[float] = 1 / 16

    _part_names: ClassVar[tuple[str, ...]] = ()

    @property
    def score_moments(self) -> tuple[int, ...]:
        """The trailing shape of one entry's score: (2,) with `score_squares` (sum, sum of squares), else ()."""
        return (2,) if self.score_squares else ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.parts, tuple) or not all(isinstance(part, Part) for part in cls.parts):
            raise H2OStreamError(f"{cls.__qualname__}.parts must be a tuple of Part declarations")
        cls._part_names = tuple(part.name for part in cls.parts)  # `budget` runs every layer and step: no rebuilding
        if not isinstance(cls.options, tuple) or not all(isinstance(option, Setting) for option in cls.options):
            raise H2OStreamError(f"{cls.__qualname__}.options must be a tuple of Setting declarations")

    @classmethod
    def part_names(cls) -> tuple[str, ...]:
        """The names of the declared parts, in order."""
        return cls._part_names

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The names of the declared settings (`options`), in order."""
        return tuple(option.name for option in cls.options)

    @classmethod
    def from_budget(cls, cache_size: int | None, **given) -> EvictionPolicy:
        """The policy for `cache_size` entries per layer and KV head, with the parts in `given` fixed.

        The parts not given take their declared defaults, in declaration order, each at most what is left; the rest
        part (or, when it was given, the last part not given) takes what remains. A policy without parts ignores the
        cache size. Anything in `given` that is not a part (settings, tokenizer-derived fields) goes to the
        constructor as it is. `make_policy` validates the values first; override this for a split the declarations
        cannot say.
        """
        parts = {name: value for name, value in given.items() if name in cls._part_names}
        others = {name: value for name, value in given.items() if name not in cls._part_names}
        if not cls.parts:
            return cls(**others)
        if cache_size is None:
            raise H2OStreamError(f"the {cls.name} policy needs a cache size")
        return cls(**split_budget(cls.parts, cache_size, parts), **others)

    @classmethod
    def tokenizer_settings(cls, tokenizer) -> dict:
        """Constructor arguments derived from the model's tokenizer (e.g. sepllm's separator ids); called by
        `make_policy` for policies with `needs_tokenizer`, which refuses to build them without a tokenizer."""
        return {}

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

    def update_scores(self, scores: torch.Tensor, received: torch.Tensor, steps: int = 1) -> None:
        """Fold the attention each entry just `received` into its `scores`, in place; both (batch, kv_heads, n).

        `received` is what `score_heads` and `score_queries` say (per KV head or the layer's mean, all of a chunk's
        queries, weighted by `query_weights`, or the last; with `score_squares` both have a last axis of 2, the sum
        and the sum of squares); a new entry's score starts at 0; `steps` is the number of queries (tokens) in the
        forward. The default accumulates (H2O); a policy may decay the old scores first
        (A2SF) or keep only the latest attention (TOVA). Called only with `needs_scores`.
        """
        scores += received

    def query_weights(self, length: int) -> torch.Tensor | None:
        """Weights of a chunk's `length` queries in the attention an entry receives (None: each counts once). A
        policy whose scores decay at every step weighs query i by the decay of the steps after it, so that a chunk
        leaves the scores its steps would (A2SF: alpha ** (length - 1 - i))."""
        return None

    @abstractmethod
    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """Slots to keep, shape (batch, kv_heads, budget), ascending so stream order is preserved.

        `positions` (batch, kv_heads, n) are stream indices in slot order (ascending); `scores` has the same shape
        (plus a last axis of 2 with `score_squares`; see `update_scores`) or is None when `needs_scores` is False.
        Called only when n > budget. A policy with `needs_keys` is also given `keys=` (batch, kv_heads, n,
        head_dim), the keys as the layer stores them (un-rotated when rolling, rotated at their stream positions
        without); one with `needs_tokens` is given `tokens=` (batch, kv_heads, n), each entry's token id. A score
        normalised by age divides by `ages(positions)` (roco).
        """

    def keep_twice(self, then: EvictionPolicy, positions: torch.Tensor, scores: torch.Tensor | None,
                   **extra: torch.Tensor) -> torch.Tensor:
        """What a cut with `keep` followed at once by a cut with `then` (this policy `reduced` to a smaller budget)
        keeps, as slots of the entries now held: (batch, kv_heads, then.budget), ascending. Arguments as for `keep`
        (n > self.budget). A fair chunk of a policy whose cuts do not nest needs both cuts before the next chunk;
        made as one, the layer gathers its tensors once. The default keeps, then keeps among the survivors; a
        policy may answer both at once more cheaply (keydiff), with the same slots."""
        first = self.keep(positions, scores, **extra)
        second = then.keep(at_slots(positions, first), None if scores is None else at_slots(scores, first),
                           **{name: at_slots(value, first) for name, value in extra.items()})
        return first.gather(-1, second)

    def drop_one(self) -> DropOne | None:
        """How this policy's exact-mode cut of one entry is made (`DropOne`), if it is that simple, so that exact mode
        may run compiled (`engine/compiled.py`); None (the default) keeps exact mode on the tensor operations."""
        return None

    def reduced(self, budget: int) -> EvictionPolicy:
        """This policy with a smaller `budget` (>= 1): what a fair chunk of C tokens keeps before it runs, at
        budget + 1 - C, so that its last query sees this policy's budget + 1 keys, as in exact mode.

        Every part but the sinks gives up slots in proportion to its size (largest remainders get the odd slots, ties
        in declaration order), so that each keeps its role (h2o's heavy hitters, sepllm's separators) at any chunk
        size; the sinks give up slots only when nothing else is left. Settings and other fields stay as they are.
        """
        if not 1 <= budget <= self.budget:
            raise H2OStreamError(f"{self.describe()} cannot be reduced to {budget} slots")
        return dataclasses.replace(self, **shrink_parts(self.split(), self.budget - budget))

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


def shrink_parts(parts: dict[str, int], cut: int) -> dict[str, int]:
    """`parts` (name -> slots) with `cut` slots fewer: see `EvictionPolicy.reduced`."""
    values = dict(parts)
    shrinkable = [name for name in values if name != SINKS.name]
    total = sum(values[name] for name in shrinkable)
    if cut >= total:
        for name in shrinkable:
            values[name] = 0
        if SINKS.name in values:
            values[SINKS.name] -= cut - total
        return values
    shares = {name: cut * values[name] / total for name in shrinkable}
    taken = {name: math.floor(share) for name, share in shares.items()}
    by_remainder = sorted(shrinkable, key=lambda name: -(shares[name] - taken[name]))  # stable: declaration order
    for name in by_remainder[: cut - sum(taken.values())]:
        taken[name] += 1
    return {name: value - taken.get(name, 0) for name, value in values.items()}


def check_count(name: str, value: int, *, minimum: int = 0) -> int:
    """`value` if it is an integer >= minimum, else a clear H2OStreamError naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise H2OStreamError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise H2OStreamError(f"{name} must be >= {minimum}, got {value}")
    return value
