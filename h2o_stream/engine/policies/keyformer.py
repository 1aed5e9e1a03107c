"""`keyformer` — Keyformer (Adnan et al. 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection for
Efficient Generative Inference", MLSys; official code d-matrix-ai/keyformer-llm, the `_attn` of its models).

H2O whose scores come from Gumbel-regularised attention: at every step each entry's score grows by what it receives
in softmax((logits + g) / tau), the model's attention logits (scaled, masked, soft-capped as the model does) plus a
Gumbel draw g per query head, query and key, at a temperature tau that rises linearly from `tau_init` to `tau_end`
over the stream's first `tau_steps` queries and then stays; the query heads of a GQA group add up into their KV head.
The model's own attention is unchanged: the noise only ranks. Keep the last `recent` entries (the recent window) and
the `heavy` highest-scored among the rest (the key tokens); ties go to the older entry. Decided per layer and KV
head.

Draws are seeded (`gumbel_seed`) and a pure function of (layer, query head, query, key) by their stream indices
(engine/draws.py), so a run repeats and exact mode, fair chunks and the oracle draw alike; the official code draws
from torch's generator (`gumbel_softmax`) in every forward.

Defaults: the official code's temperatures 1 to 2 and its recent window of 30% of the cache (the rest key tokens).
The official code spreads the rise over the tokens it generates after a prompt; a stream has no such length, and
`tau_steps` 0 (the default) spreads it over as many queries as the cache holds — our choice, not the paper's.
The official code's cache size counts the newest token (its recent window holds it); here, as for every policy, the
budget is what is held between steps and a query sees the budget + 1 entries.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import EvictionPolicy, Part, Scores, setting
from .ranking import SCORE
from .registry import register


@register
@dataclass
class KeyformerPolicy(EvictionPolicy):
    heavy: int
    recent: int
    tau_init: float = setting(
        1.0,
        "the Gumbel softmax's temperature at the stream's start",
        within=(0, 1e6),
        called="keyformer's first temperature",
    )
    tau_end: float = setting(
        2.0,
        "the temperature the rise ends at, then held",
        within=(0, 1e6),
        called="keyformer's last temperature",
    )
    tau_steps: int = setting(
        0,
        "queries over which the temperature rises (0: as many as the cache holds)",
        within=(-1, 1 << 40),
        called="0: the cache size",
    )
    gumbel_seed: int = setting(
        0, "seed of the Gumbel draws (a run repeats with the same seed)", within=(-1, (1 << 32) - 1)
    )
    name = "keyformer"
    parts = (
        Part("heavy", "key-token slots, the highest Gumbel-regularised scores among the older entries"),
        Part("recent", "recent-window slots, the last entries", share=0.3),
    )
    scoring = Scores("sum", gumbel=True)
    ranking = SCORE

    def __post_init__(self):
        super().__post_init__()
        if self.tau_steps == 0:  # a stream has no generation length to spread the rise over: the cache's
            self.tau_steps = max(self.budget, 1)
