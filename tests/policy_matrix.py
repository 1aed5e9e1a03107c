"""The tests' policy matrix, read from the registry: a new policy file is picked up by every test that can take it.

ALL: every registered policy, built by `build(name, size)` (with TOKENIZER for those that need the model's tokenizer,
sepllm, and the example of any setting that must be given, head_hybrid's). EVICTING: those with budget parts (a
bounded cache). BANDED: evicting policies with a band (chunked mode equals exact mode). SCORED: evicting policies
that decide from attention scores. TOKENIZED: the policies that need the tokenizer; a test that builds policies from
these lists builds them with `build`, not `make_policy`.
"""

from __future__ import annotations

from h2o_stream.engine.policies import POLICIES, EvictionPolicy, make_policy
from tiny_models import char_tokenizer

#: the tokenizer of the tiny models (tests/tiny_models.py): its ids fit their vocabulary, and it has separators
TOKENIZER = char_tokenizer()


def build(name: str, cache_size: int | None = None, **parts) -> EvictionPolicy:
    """`make_policy(name, cache_size, **parts)` with the tiny models' tokenizer (used only by policies needing one).

    A policy with a per-layer schedule (pyramid) gets half the cache as its recent window and beta 2 unless given:
    at its defaults the highest layer of a cache of 8 keeps a single entry, too few for the chunks (up to 5) the
    tests feed; so its smallest layer keeps 6 of 8 and every layer takes them."""
    if POLICIES[name].layer_schedule is not None and cache_size:
        parts = {"recent": cache_size // 2, "beta": 2, **parts}
    required = {option.name: option.example for option in POLICIES[name].options if option.required}
    parts = {**required, **parts}  # a setting no default runs (head_hybrid's classes): one that runs on any model
    return make_policy(name, cache_size, tokenizer=TOKENIZER, **parts)


TOKENIZED = [name for name, cls in POLICIES.items() if cls.needs_tokenizer]
ALL = list(POLICIES)
EVICTING = [name for name in ALL if POLICIES[name].parts]
BANDED = [name for name in EVICTING if build(name, 24).band() is not None]
SCORED = [name for name in EVICTING if POLICIES[name].needs_scores]
