"""The tests' policy matrix, read from the registry: a new policy file is picked up by every test that can take it.

ALL: every registered policy, built by `build(name, size)` (with TOKENIZER for those that need the model's tokenizer,
sepllm, and every setting's declared example, such as head_hybrid's classes, which must be given). EVICTING: those
with budget parts (a bounded cache). BANDED: evicting policies with a band (chunked mode equals exact mode). SCORED:
evicting policies that decide from attention scores. TOKENIZED: the policies that need the tokenizer; a test that
builds policies from these lists builds them with `build`, not `make_policy`.
"""

from __future__ import annotations

from h2o_stream.engine.policies import POLICIES, EvictionPolicy, make_policy
from support.tiny_models import char_tokenizer

#: the tokenizer of the tiny models (tests/support/tiny_models.py): its ids fit their vocabulary, and it has separators
TOKENIZER = char_tokenizer()


def build(name: str, cache_size: int | None = None, **parts) -> EvictionPolicy:
    """`make_policy(name, cache_size, **parts)` with the tiny models' tokenizer (used only by policies needing one).

    A policy with a per-layer schedule (pyramid) gets half the cache as its recent window and beta 2 unless given:
    at its defaults the highest layer of a cache of 8 keeps a single entry, too few for the chunks (up to 5) the
    tests feed; so its smallest layer keeps 6 of 8 and every layer takes them. A fixed part that would take half
    of a tiny cache or more (scissorhands' recent window of 10) takes a quarter of it instead."""
    if POLICIES[name].layer_schedule is not None and cache_size:
        parts = {"recent": cache_size // 2, "beta": 2, **parts}
    # a fixed part sized for real caches (scissorhands' recent window of 10) would leave a tiny cache nothing to rank
    for part in POLICIES[name].parts:
        if cache_size and part.name != "sinks" and part.fixed is not None and part.fixed >= cache_size // 2:
            parts = {part.name: cache_size // 4, **parts}
    # a setting's example: one that runs on any model and tiny cache (head_hybrid's classes, which no default is;
    # scissorhands' quantile, whose default counts nothing in a row of 9 keys)
    examples = {option.name: option.example for option in POLICIES[name].options if option.example is not None}
    parts = {**examples, **parts}
    return make_policy(name, cache_size, tokenizer=TOKENIZER, **parts)


TOKENIZED = [name for name, cls in POLICIES.items() if cls.needs_tokenizer]
ALL = list(POLICIES)
EVICTING = [name for name in ALL if POLICIES[name].parts]
BANDED = [name for name in EVICTING if build(name, 24).band() is not None]
SCORED = [name for name in EVICTING if POLICIES[name].needs_scores]
