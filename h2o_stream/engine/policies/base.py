"""The policy seam: a policy is a declaration, and everything the engine asks of it is derived from that here.

A policy declares (docs/design.md, "Writing a policy"):
- `parts`: its budget, in cache slots (`Part`); a part named `sinks` protects the stream's first tokens, one named
  `recent` the newest entries; every other part is filled by rank;
- its settings that are not slot counts: dataclass fields declared with `setting` (its `options` are made from them,
  `Setting`), checked when the policy is made;
- `scoring`: how the attention an entry receives becomes its score (`Scores`), or None: no scores (the fused
  attention path stays);
- `ranking`: how the entries between the sinks and the recent window are ranked for the ranked parts, one of the
  objects of ranking.py (`AGE`, none ranked: a band; `SCORE`, `MEAN`, `KEY_DIVERSITY`, ...); or, simplest, a method
  `score(entries)` of its own (`Entries`): the entries of highest score are kept (ranking `OWN_SCORE`);
- optionally `fair_chunk_share` (the default fair chunk, as a share of the budget), `tokenizer_settings` (fields
  derived from the tokenizer, for "token_class") and `fit_model` (refusing a model its settings do not name).

From these the engine gets, for every path alike (tensor operations, the compiled exact-mode loop, fair chunks, the
tests' oracle): whether layers carry scores and of what shape, how a step's attention updates them
(`update_scores`, `query_weights`), which slots a cut keeps (`keep`, `keep_twice`), the band of a policy that needs no
decision inside a chunk (`band`), the compiled loop's rule (`drop_one`), and whether cuts nest (`cuts_nest`); the
ranking object answers what depends on the ranking. A policy whose cut no ranking says overrides `keep` (ranking
None); it then runs on the tensor operations only.
The declaration is checked when its class is defined (validation.py); the scores' arithmetic is in scoring.py.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # torch is imported where it is used: the registry loads without it (__init__.py)
    import torch

from h2o_stream.errors import H2OStreamError

from .declarations import (
    HEAVY,
    RECENT,
    SINKS,
    DropOne,
    Part,
    Scores,
    Setting,
    check_count,
    field_settings,
    pyramid_budgets,
    setting,
    shrink_parts,
    split_budget,
)
from .ranking import AGE, OWN_SCORE, Entries, Ranking
from .slots import at_slots
from .validation import check_declaration

__all__ = [
    "HEAVY",
    "RECENT",
    "SINKS",
    "DropOne",
    "Entries",
    "EvictionPolicy",
    "Part",
    "Scores",
    "Setting",
    "check_count",
    "setting",
    "shrink_parts",
    "split_budget",
]


class EvictionPolicy:
    """Chooses which cache entries to keep once a layer holds more than `budget` entries per KV head.

    Subclasses are dataclasses whose fields are their parts and settings, so that `type(policy)(**vars(policy))`
    rebuilds a policy and `settings()` identifies it in checkpoints and results.
    """

    name: ClassVar[str]
    #: the budget parts this policy takes, in the order they are printed; they add up to the budget
    parts: ClassVar[tuple[Part, ...]] = ()
    #: settings that are not slot counts: made from the fields declared with `setting` when the class is defined
    #: (`field_settings`), never written by hand
    options: ClassVar[tuple[Setting, ...]] = ()
    #: how attention becomes an entry's score; None: no scores
    scoring: ClassVar[Scores | None] = None
    #: how the entries between the protected ends are ranked (ranking.py); None: the policy's own `keep`
    ranking: ClassVar[Ranking | None] = AGE
    #: the default chunk in fair chunked mode, as a share of the budget (`default_chunk_size`, which also keeps it
    #: within the recent window + 1): small enough that chunked perplexity stays within 1% of exact mode's (measured
    #: per policy, eval/results/quality/gap.json)
    fair_chunk_share: ClassVar[float] = 1 / 16
    #: a per-layer split of the budget (SCHEDULES: "pyramid", reading the setting `beta`), the same total memory as
    #: the budget in every layer; None: every layer the budget
    layer_schedule: ClassVar[str | None] = None
    #: what a cut does with what it evicts: "drop", or "merge" (cam: each merged into the entries after it, by the
    #: latest attention and a seeded coin; policies/merging.py; needs Scores("latest") and validation.MERGE_SETTINGS)
    eviction: ClassVar[str] = "drop"

    # -- derived from the declaration, per class (the engine and the command line read them) ------------------------
    #: whether layers keep scores (an explicit softmax); policies without keep the fused attention path
    needs_scores: ClassVar[bool] = False
    #: which queries of a chunk count: "all", or "last" (only its last query: "latest" scores)
    score_queries: ClassVar[str] = "all"
    #: whether scores also sum the squares of what each query gave (a last axis of 2: "moments")
    score_squares: ClassVar[bool] = False
    #: whether `keep` reads the keys the layer holds (as the layer stores them: un-rotated when rolling)
    needs_keys: ClassVar[bool] = False
    #: whether `keep` reads the values the layer holds
    needs_values: ClassVar[bool] = False
    #: whether `keep` reads every entry's token id (forwards must bring token ids)
    needs_tokens: ClassVar[bool] = False
    #: whether building the policy needs the model's tokenizer (`tokenizer_settings`)
    needs_tokenizer: ClassVar[bool] = False
    #: the settings that must be given (`Setting.required`); the leaderboard runs such a policy only when named
    required_options: ClassVar[tuple[str, ...]] = ()
    #: whether `keep` reads the index of the model layer it cuts (`layer=`: "head_class")
    needs_layer: ClassVar[bool] = False
    _part_names: ClassVar[tuple[str, ...]] = ()
    #: made by @dataclass on every subclass (see the class docstring): `dataclasses.replace` rebuilds a policy
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.parts, tuple) or not all(isinstance(part, Part) for part in cls.parts):
            raise H2OStreamError(f"{cls.__qualname__}.parts must be a tuple of Part declarations")
        cls.options = field_settings(cls)  # before check_declaration, which reads them
        cls._part_names = tuple(part.name for part in cls.parts)  # `budget` runs every layer and step: no rebuilding
        if "score" in cls.__dict__ and "ranking" not in cls.__dict__:
            cls.ranking = OWN_SCORE  # ranked by a score of its own
        if "keep" in cls.__dict__ and "ranking" not in cls.__dict__:
            cls.ranking = None  # a cut of its own
        if cls.ranking is None and cls.keep is EvictionPolicy.keep:
            raise H2OStreamError(f"{cls.__qualname__} ranks nothing (ranking None) and needs a `keep` of its own")
        check_declaration(cls)  # the rest of the declaration (validation.py)
        cls.needs_scores = cls.scoring is not None
        cls.score_queries = "last" if cls.needs_scores and cls.scoring.rule.last_query_only else "all"
        cls.score_squares = cls.needs_scores and cls.scoring.rule.squares
        ranking = cls.ranking
        cls.needs_keys = ranking is not None and ranking.needs_keys
        cls.needs_values = ranking is not None and ranking.needs_values
        cls.needs_tokens = cls.needs_tokenizer = ranking is not None and ranking.needs_tokens
        cls.needs_layer = ranking is not None and ranking.needs_layer
        cls.required_options = tuple(option.name for option in cls.options if option.required)

    @classmethod
    def _ranked_part_names(cls) -> tuple[str, ...]:
        return tuple(name for name in cls._part_names if name not in ("sinks", "recent"))

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
        """The policy for `cache_size` entries per layer and KV head, with the parts in `given` fixed: the others take
        their declared defaults in declaration order, each at most what is left, and the rest part (or, when it was
        given, the last part not given) what remains. A policy without parts ignores the cache size; what in `given`
        is no part (settings, tokenizer-derived fields) goes to the constructor as it is. `make_policy` validates
        the values first."""
        parts = {name: value for name, value in given.items() if name in cls._part_names}
        others = {name: value for name, value in given.items() if name not in cls._part_names}
        if not cls.parts:
            return cls(**others)
        if cache_size is None:
            raise H2OStreamError(f"the {cls.name} policy needs a cache size")
        return cls(**split_budget(cls.parts, cache_size, parts), **others)

    @classmethod
    def tokenizer_settings(cls, tokenizer) -> dict:
        """Constructor arguments from the model's tokenizer (sepllm's separator ids), for `needs_tokenizer`."""
        return {}

    def __post_init__(self):
        for part in self.parts:
            check_count(part.name, getattr(self, part.name))
        if self.parts and self.budget < 1:
            raise H2OStreamError(f"{self.name} policy needs {' + '.join(self.part_names())} >= 1")
        for option in self.options:
            setattr(self, option.name, option.check(getattr(self, option.name)))

    # -- the budget ---------------------------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """Entries kept per layer and KV head between steps (the sum of the parts); None means unbounded."""
        if not self._part_names:
            return None
        total = 0
        for name in self._part_names:
            total += getattr(self, name)
        return total

    @property
    def protected_sinks(self) -> int:
        """The stream's first entries, never cut (the `sinks` part; 0 without one)."""
        return getattr(self, "sinks", 0) if "sinks" in self._part_names else 0

    @property
    def protected_recent(self) -> int:
        """The newest entries, never cut (the `recent` part; 0 without one)."""
        return getattr(self, "recent", 0) if "recent" in self._part_names else 0

    @property
    def ranked_slots(self) -> int:
        """Slots filled by rank: the budget less the protected ends."""
        budget = self.budget
        assert budget is not None, "an unbounded policy never cuts: nothing is ranked"
        return budget - self.protected_sinks - self.protected_recent

    def for_layers(self, count: int) -> list[EvictionPolicy]:
        """The policy of each of `count` layers running this one, lowest first: itself in every layer, or with a
        `layer_schedule` its ranked part spread over the layers (the same total; declarations.pyramid_budgets)."""
        if self.layer_schedule is None or self.budget is None:
            return [self] * count
        (part,) = self._ranked_part_names()
        budgets = pyramid_budgets(getattr(self, part), count, self._whole_setting("beta"))
        if self.budget - getattr(self, part) + min(budgets) < 1:
            raise H2OStreamError(
                f"{self.describe()} leaves its highest layer no slot at all; use a larger cache, a "
                "recent window or a smaller beta"
            )
        return [dataclasses.replace(self, **{part: slots}) for slots in budgets]

    def fit_model(self, layers: list[int], kv_heads: int, model: str) -> None:
        """Refuse (H2OStreamError) a model whose `layers` running this policy, `kv_heads` or signature `model` its
        settings do not fit (head_hybrid's classes), when a cache is made for it."""

    # -- scores -------------------------------------------------------------------------------------------------
    @property
    def score_heads(self) -> str:
        """Whose attention makes a score: "kv" (per KV head, its query heads summed) or "layer" (the mean over every
        query head of the layer)."""
        heads = "kv" if self.scoring is None else self.scoring.heads
        if heads in ("kv", "layer"):
            return heads
        return "kv" if getattr(self, heads) else "layer"

    @property
    def score_window(self) -> int:
        """The observation window of "window" scores (the last queries whose attention counts), else 0."""
        if self.scoring is None or not self.scoring.rule.windowed:
            return 0
        return int(self._value_of(self.scoring.window))

    @property
    def score_moments(self) -> tuple[int, ...]:
        """An entry's score's trailing shape: (2,) "moments" (sum, sum of squares), (window,) "window", else ()."""
        if self.score_squares:
            return (2,)
        return (self.score_window,) if self.score_window else ()

    @property
    def decay(self) -> float:
        """The factor old scores are multiplied by at each step (1 but for "decay" scores)."""
        if self.scoring is None or not self.scoring.rule.decays:
            return 1.0
        return float(self._value_of(self.scoring.decay))

    @property
    def gumbel(self) -> bool:
        """Whether scores come from Gumbel-regularised attention (`Scores.gumbel`), not the model's own."""
        return self.scoring is not None and self.scoring.gumbel

    @property
    def score_quantile(self) -> float:
        """The quantile a query head's row must be above for a "window" score to count it (`Scores.quantile`), or 0."""
        return 0.0 if self.scoring is None else float(self._value_of(self.scoring.quantile))

    def _value_of(self, declared: float | str) -> float:
        """A `Scores` number as declared: the number itself, or the value of the setting it names."""
        return getattr(self, declared) if isinstance(declared, str) else declared

    def _whole_setting(self, name: str) -> int:
        """The value of the whole-number setting `name`, one that the declaration has (validation.py: a schedule's,
        a merge's)."""
        value = getattr(self, name)
        assert isinstance(value, int), f"{name} is a whole-number setting"  # Setting.check made it one
        return value

    def update_scores(self, scores: torch.Tensor, received: torch.Tensor, steps: int = 1) -> None:
        """Fold the attention each entry just `received` into its `scores`, in place; both (batch, kv_heads, n[, 2]),
        `received` as `score_heads` and `score_queries` say (weighted by the scoring's `query_weights`); `steps` is
        the number of queries (tokens) in the forward. Called only with `needs_scores`."""
        assert self.scoring is not None, "a policy without scores has none to update"
        self.scoring.rule.update(self, scores, received, steps)

    # -- cuts ---------------------------------------------------------------------------------------------------
    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None, **extra: torch.Tensor | int) -> torch.Tensor:
        """Slots to keep, shape (batch, kv_heads, budget), ascending so stream order is preserved: the sinks, the
        `ranked_slots` highest ranks between them and the recent window (ties to the older entry), the recent window.

        `positions` (batch, kv_heads, n) are stream indices in slot order (ascending); `scores` the same shape (plus a
        last axis of 2 for "moments") or None without scoring; `keys=` (batch, kv_heads, n, head_dim) with
        `needs_keys`, `values=` with `needs_values`, `tokens=` with `needs_tokens`, `layer=` (the model layer's index)
        with `needs_layer`. Called only when n > budget."""
        # ranking None: a `keep` of the policy's own replaces this one (__init_subclass__ refuses one without)
        assert self.ranking is not None
        return self.ranking.keep(self, positions, scores, **extra)

    def merged(
        self, values: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor, kept: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """`values` (batch, kv_heads, n, dim) once the entries a cut does not keep (`kept`, bool (batch, kv_heads, n))
        are merged into the entries after them (eviction "merge": policies/merging.py), in layer `layer`."""
        from .merging import merge_evicted

        span, seed = self._whole_setting("merge_span"), self._whole_setting("merge_seed")
        return merge_evicted(values, positions, scores, kept, span=span, seed=seed, layer=layer)

    def keep_twice(
        self, then: EvictionPolicy, positions: torch.Tensor, scores: torch.Tensor | None, **extra: torch.Tensor | int
    ) -> torch.Tensor:
        """What a cut with `keep` followed at once by a cut with `then` (this policy `reduced` to a smaller budget)
        keeps, as slots of the entries now held: (batch, kv_heads, then.budget), ascending. A fair chunk of a policy
        whose cuts do not nest needs both before the next chunk; made as one, the layer gathers its tensors once."""
        both = None if self.ranking is None else self.ranking.keep_twice(self, then, positions, scores, **extra)
        if both is not None:  # the ranking's two cuts made as one
            return both
        if scores is not None and self.score_window:  # rankings read a window's sum: gather one column, not all
            scores = scores.sum(-1, keepdim=True)
        first = self.keep(positions, scores, **extra)
        second = then.keep(
            at_slots(positions, first),
            None if scores is None else at_slots(scores, first),
            **{name: value if isinstance(value, int) else at_slots(value, first) for name, value in extra.items()},
        )
        return first.gather(-1, second)

    @property
    def cuts_nest(self) -> bool:
        """Whether cutting to the budget and then to a `reduced` budget keeps what one cut to the reduced budget keeps
        (scores unchanged), as the ranking says (`Ranking.nests`): True for one fixed order of the entries. Between two
        fair chunks such a policy makes one cut, with `reduced`; any other both at once (`keep_twice`)."""
        return self.ranking is not None and self.ranking.nests(self)

    def band(self) -> tuple[int, int] | None:
        """(sinks, recent) if every query keeps exactly the first `sinks` stream tokens and its last `recent`
        predecessors (a ranking that ranks nothing, no scores): no decision inside a chunk, so chunked mode can equal
        exact mode with a banded mask. None for every other policy."""
        if self.ranking is None or self.ranking.ranks_entries or self.scoring is not None or self.budget is None:
            return None
        return self.protected_sinks, self.protected_recent

    def drop_one(self) -> DropOne | None:
        """Exact mode's one-entry cut for the compiled loop (`engine/compiled.py`), from the declaration: the
        ranking's (`Ranking.drop_one`) on the model's own attention, dropping what it evicts; None for a ranking
        without one, for window and Gumbel-regularised scores and for merging (exact mode stays on the tensor
        operations)."""
        if self.budget is None or self.ranking is None or self.score_window or self.gumbel or self.eviction != "drop":
            return None
        return self.ranking.drop_one(self)

    def reduced(self, budget: int) -> EvictionPolicy:
        """This policy with a smaller `budget` (>= 1): what a fair chunk of C tokens keeps before it runs, at
        budget + 1 - C, so that its last query sees this policy's budget + 1 keys, as in exact mode.

        Every part but the sinks gives up slots in proportion to its size (largest remainders get the odd slots, ties
        in declaration order), so that each keeps its role (h2o's heavy hitters, sepllm's separators) at any chunk
        size; the sinks give up slots only when nothing else is left. Settings and other fields stay as they are.
        """
        total = self.budget
        if total is None or not 1 <= budget <= total:  # (an unbounded policy has no budget to reduce)
            raise H2OStreamError(f"{self.describe()} cannot be reduced to {budget} slots")
        return dataclasses.replace(self, **shrink_parts(self.split(), total - budget))

    # -- description ----------------------------------------------------------------------------------------------
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
