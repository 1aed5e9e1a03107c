"""The declarations a policy is made of: its budget parts (`Part`), its other settings (`Setting`, each declared as
its dataclass field with `setting`), how attention becomes a score (`Scores`), and the arithmetic of budgets
(splitting a cache size, shrinking for a fair chunk). `DropOne` is what the compiled loop reads, derived from them.
No torch here: the registry loads without it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, TypeVar

from h2o_stream.errors import H2OStreamError

from .scoring import ACCUMULATIONS, Accumulation


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
    """A policy setting that is not a number of slots (e.g. a2sf's forgetting factor), as the policy's `options` hold
    it, made from its dataclass field (`setting`): `name` is the constructor argument, `default` its value when not
    given, `help` what its command-line option says. A bool default makes it a flag; a number's value must lie in
    `within` (low, high], checked when the policy is made (`called` names it in the error); a str default makes it
    text, which the policy reads itself. A `required` setting has no default a policy can run with (head_hybrid's
    head classification): making the policy without it is refused (`h2o-stream leaderboard` leaves such a policy
    out unless it is named). `example`: a value that runs on any model and in a tiny cache, what the tests give
    (required settings need one)."""

    name: str
    help: str
    default: float | bool | str
    within: tuple[float, float] | None = None
    called: str = ""
    odd: bool = False
    required: bool = False
    example: float | bool | str | None = None

    def __post_init__(self):
        if not self.name.isidentifier():
            raise H2OStreamError(f"a policy setting needs a name usable as an argument, got {self.name!r}")
        if not isinstance(self.help, str) or not self.help.strip():
            raise H2OStreamError(f"the policy setting {self.name!r} needs a help text, its command-line option's")
        if self.required and self.example is None:
            raise H2OStreamError(f"the required setting {self.name!r} needs an example value")

    def check(self, value, label: str = ""):
        """`value` as the policy keeps it (a float for a number), or a clear H2OStreamError naming the setting as
        `label` (default: its name; a command line names its option)."""
        label = label or self.name
        if self.required and value == self.default:
            raise H2OStreamError(f"{label} must be given: {self.called or self.help}")
        if isinstance(self.default, str):
            if not isinstance(value, str):
                raise H2OStreamError(f"{label} must be text, got {value!r}")
            return value
        if isinstance(self.default, bool):
            if not isinstance(value, bool):
                raise H2OStreamError(f"{label} must be true or false, got {value!r}")
            return value
        low, high = self.within if self.within is not None else (-math.inf, math.inf)
        whole = isinstance(self.default, int)
        kind = ("an odd whole number" if self.odd else "a whole number") if whole else "a number"
        if (
            isinstance(value, bool)
            or not isinstance(value, int if whole else (int, float))
            or not math.isfinite(value)
            or not low < value <= high
            or (self.odd and value % 2 == 0)
        ):
            what = f"{label} ({self.called})" if self.called else label
            where = f" in ({_bound(low)}, {_bound(high)}]" if self.within is not None else ""
            raise H2OStreamError(f"{what} must be {kind}{where}, got {value!r}")
        return value if whole else float(value)


_Default = TypeVar("_Default", bound="float | str")  # a bool is an int, which is a float to a type checker

#: where a field made by `setting` keeps what it declares besides its default (its field's metadata)
SETTING_METADATA = "h2o_stream.setting"


def setting(
    default: _Default,
    help: str,
    *,
    within: tuple[float, float] | None = None,
    called: str = "",
    odd: bool = False,
    required: bool = False,
    example: float | bool | str | None = None,
) -> _Default:
    """A policy's setting, declared once as its dataclass field: `alpha: float = setting(0.95, "forgetting factor",
    within=(0, 1))`. The field's name and default are the setting's; the rest is `Setting`'s. The policy's `options`
    are made from these fields when its class is defined (`field_settings`)."""
    declared = {"help": help, "within": within, "called": called, "odd": odd, "required": required, "example": example}
    return dataclasses.field(default=default, metadata={SETTING_METADATA: declared})


def field_settings(cls: type) -> tuple[Setting, ...]:
    """The settings of policy class `cls`, when it is defined (before @dataclass makes its fields): its bases' (their
    `options`), then its own fields declared with `setting`, in the order @dataclass gives the fields (one that
    redeclares a base's keeps its place). An `options` written by hand, or a base's setting redeclared as a plain
    field, is refused: each setting has one declaration, its field."""
    if "options" in vars(cls):
        raise H2OStreamError(
            f"{cls.__qualname__}.options are made from its fields: declare each setting as one, with setting(...)"
        )
    settings = {option.name: option for option in getattr(cls, "options", ())}
    for name in vars(cls).get("__annotations__", {}):
        declared: Any = vars(cls).get(name)
        if isinstance(declared, dataclasses.Field) and SETTING_METADATA in declared.metadata:
            default = declared.default
            assert default is not dataclasses.MISSING  # `setting` gives every field it makes a default
            settings[name] = Setting(name, default=default, **declared.metadata[SETTING_METADATA])
        elif name in settings:
            raise H2OStreamError(f"{cls.__qualname__}.{name} redeclares a setting: declare it with setting(...)")
    return tuple(settings.values())


def _bound(value: float) -> str:
    """A setting's bound as a message shows it: a whole value exactly (`g` would round 2**32 - 1 to 4.29497e+09)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Scores:
    """How the attention an entry receives becomes its score (a policy with `scoring = Scores(...)`; one without keeps
    the fused attention path and its layers carry no scores). A new entry's score starts at 0; at each step (query):

    - "sum": score += received (H2O);
    - "decay": score = decay * score + received (A2SF); `decay` is a number or the name of the setting holding it;
    - "latest": score = received, the current query's alone (TOVA); in a chunk only its last query counts;
    - "moments": the sum and the sum of squares of what each step gave, a last axis of 2 (RoCo's mean and variance);
    - "window": what each of the last `window` queries gave, a last axis of `window` (oldest first), the score their
      sum: attention from an observation window of the latest queries (SnapKV); `window` is a number or the name of
      the setting holding it.

    `heads`: whose attention counts — "kv", per KV head the query heads reading it summed (GQA/MQA); "layer", the mean
    over every query head of the layer, one decision per layer; or the name of a bool setting: "kv" when it is true,
    else "layer" (TOVA's per_head).

    `quantile` (with "window"; a number or the name of the setting holding it, 0: off): what a query gives an entry
    is not its attention but how many of the query heads reading its KV head gave it more than the `quantile` of
    that head's row (the value at ascending index floor(quantile * n) of the n keys the query sees), so that the
    score counts the latest queries that found the entry important (Scissorhands' persistence of importance).

    `gumbel`: what an entry receives is not the model's attention but its Gumbel-regularised twin (Keyformer), per
    query softmax((logits + g) / tau) with a seeded Gumbel draw g per query head, query and key (engine/draws.py)
    and a temperature tau rising from `tau_init` to `tau_end` over the stream's first `tau_steps` queries; the policy
    declares those three settings and `gumbel_seed`."""

    accumulate: str = "sum"
    heads: str = "kv"
    decay: float | str = 1.0
    window: int | str = 0
    quantile: float | str = 0.0
    gumbel: bool = False

    def __post_init__(self):
        if self.accumulate not in ACCUMULATIONS:
            raise H2OStreamError(f"scores accumulate by one of {', '.join(ACCUMULATIONS)}, not {self.accumulate!r}")
        refusal = self.rule.refusal(self)
        if refusal is not None:
            raise H2OStreamError(refusal)

    @property
    def rule(self) -> Accumulation:
        """The accumulation `accumulate` names (scoring.py): what the engine asks."""
        return ACCUMULATIONS[self.accumulate]


@dataclass(frozen=True)
class DropOne:
    """Exact mode's cut of one entry (a layer holding budget + 1) as the compiled loop (`engine/compiled.py`) makes
    it, derived from a policy's declaration (`EvictionPolicy.drop_one`); the loop then drops what `keep` would: per
    KV head, the slots below `sinks` and the last `recent` slots are never dropped; of the others, with `ranked`, the
    lowest score goes (of equal lowest, the newest: `keep`'s ties to the older entry), else the oldest one.

    Scores, with `ranked`: a new entry starts at 0 and each step `score <- decay * score + received`, or
    `score <- received` with `latest_only` (the current query's attention alone); received per KV head or the
    layer's mean, as the policy's `Scores.heads` says. With `by_mean` (ranking "mean", moments) the scores also sum the
    squares of what each step gave, the rank is the mean over the entry's age, and of the candidates the `volatile`
    of highest variance (of equal variance, the older) are never dropped."""

    sinks: int
    recent: int
    ranked: bool
    decay: float = 1.0
    latest_only: bool = False
    by_mean: bool = False
    volatile: int = 0


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
                default = part.default(cache_size)
                assert default is not None  # only a rest part has none, and a policy has one at most (registry.py)
                values[part.name] = min(default, left)
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


#: per-layer budget schedules a policy can declare (`EvictionPolicy.layer_schedule`)
SCHEDULES = ("pyramid",)


def pyramid_budgets(ranked: int, layers: int, beta: int) -> list[int]:
    """PyramidKV's per-layer split of `ranked` slots per layer (the budget less its recent window), lowest layer
    first: from max = 2 * ranked - min down to min = ranked // beta in equal steps, rounded so that the layers hold
    exactly `layers * ranked` in all (largest remainders one slot more, ties to the lower layer). The official code
    rounds the step down instead, and its layers then hold more than that (up to (layers - 1) * layers / 2 slots)."""
    if layers <= 1:
        return [ranked] * layers
    low = ranked // beta
    high = 2 * ranked - low
    exact = [high - (high - low) * layer / (layers - 1) for layer in range(layers)]
    floors = [math.floor(value) for value in exact]
    extra = layers * ranked - sum(floors)
    by_remainder = sorted(range(layers), key=lambda layer: -(exact[layer] - floors[layer]))  # stable: lower first
    for layer in by_remainder[:extra]:
        floors[layer] += 1
    return floors
