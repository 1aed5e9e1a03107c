"""What a policy's declaration must say to make sense, checked once, when its class is defined
(`EvictionPolicy.__init_subclass__`, base.py): the kinds of its declarations, a ranking that the scoring can feed,
a layer schedule that has one ranked part to spread, and the settings a schedule, Gumbel-regularised scores and
merging read.
Each refusal is one H2OStreamError naming the class. No torch here: the registry loads without it."""

from __future__ import annotations

from h2o_stream.errors import H2OStreamError

from .declarations import SCHEDULES, Scores
from .ranking import Ranking

#: the settings a policy with Gumbel-regularised scores declares (`Scores.gumbel`)
GUMBEL_SETTINGS = ("tau_init", "tau_end", "tau_steps", "gumbel_seed")
#: what a cut does with the entries it evicts (`EvictionPolicy.eviction`)
EVICTIONS = ("drop", "merge")
#: the settings a policy that merges declares
MERGE_SETTINGS = ("merge_span", "merge_seed")
#: the settings a policy with a per-layer schedule declares, by schedule (`EvictionPolicy.layer_schedule`)
SCHEDULE_SETTINGS = {"pyramid": ("beta",)}


def check_declaration(cls) -> None:
    """Refuse (H2OStreamError) the declaration of policy class `cls`, whose parts are checked and named already
    (`_part_names`), whose `options` are made from its fields (`declarations.field_settings`) and whose `ranking` is
    None if it has a `keep` of its own."""
    if cls.scoring is not None and not isinstance(cls.scoring, Scores):
        raise H2OStreamError(f"{cls.__qualname__}.scoring must be a Scores declaration or None")
    if cls.ranking is not None and not isinstance(cls.ranking, Ranking):
        raise H2OStreamError(
            f"{cls.__qualname__}.ranking must be a Ranking (policies/ranking.py: AGE, SCORE, MEAN, ...; or None "
            f"with a `keep` of its own), not {cls.ranking!r}"
        )
    refusal = None if cls.ranking is None else cls.ranking.refusal(cls)
    if refusal is not None:
        raise H2OStreamError(f"{cls.__qualname__} {refusal}")
    if cls.layer_schedule is not None and (
        cls.layer_schedule not in SCHEDULES
        or cls.ranking is None
        or not cls.ranking.ranks_entries
        or len(cls._ranked_part_names()) != 1
    ):
        raise H2OStreamError(
            f"{cls.__qualname__}.layer_schedule must be one of {', '.join(SCHEDULES)}, for a "
            "policy with a ranking and one ranked part"
        )
    if cls.layer_schedule is not None and not set(SCHEDULE_SETTINGS[cls.layer_schedule]) <= set(cls.option_names()):
        raise H2OStreamError(
            f"{cls.__qualname__} has a {cls.layer_schedule} schedule and needs the settings "
            f"{', '.join(SCHEDULE_SETTINGS[cls.layer_schedule])}"
        )
    if cls.scoring is not None and cls.scoring.gumbel and not set(GUMBEL_SETTINGS) <= set(cls.option_names()):
        raise H2OStreamError(
            f"{cls.__qualname__} has Gumbel-regularised scores and needs the settings {', '.join(GUMBEL_SETTINGS)}"
        )
    if cls.eviction not in EVICTIONS:
        raise H2OStreamError(f"{cls.__qualname__}.eviction must be one of {', '.join(EVICTIONS)}")
    if cls.eviction == "merge" and (
        cls.scoring is None
        or not cls.scoring.rule.last_query_only
        or cls.scoring.heads != "kv"
        or not set(MERGE_SETTINGS) <= set(cls.option_names())
    ):
        raise H2OStreamError(
            f"{cls.__qualname__} merges what it evicts and needs Scores('latest') per KV head "
            f"and the settings {', '.join(MERGE_SETTINGS)}"
        )
