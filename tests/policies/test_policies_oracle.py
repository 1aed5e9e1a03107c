"""The policy zoo against the oracle written from the design's semantics (exact mode): settings the registry's
defaults do not reach (tova per KV head, a2sf's forgetting factor, h2o_sinks without sinks) and sepllm, which needs
separator ids. tests/engine/test_engine.py runs every registered evicting policy at its default split."""

from __future__ import annotations

import pytest

from h2o_stream import make_policy
from h2o_stream.engine.policies.sepllm import SepLLMPolicy
from support.oracle import first_head_ever_differs, run_against_oracle, stream_for
from support.tiny_models import VOCAB, random_ids

BUDGET = 8
#: a quarter of the tiny vocabulary as separators, so that random streams hold plenty of them (and of the rest)
SEPARATORS = tuple(range(2, VOCAB, 4))

VARIANTS = {
    "tova-per-head": lambda: make_policy("tova", BUDGET, per_head=True),
    "a2sf-alpha-0.5": lambda: make_policy("a2sf", BUDGET, alpha=0.5, heavy=5),
    "a2sf-alpha-1": lambda: make_policy("a2sf", BUDGET, alpha=1.0),
    "h2o_sinks-2": lambda: make_policy("h2o_sinks", BUDGET, sinks=2, heavy=3),
    "keydiff-no-window": lambda: make_policy("keydiff", BUDGET, sinks=1, recent=0),
    "sepllm": lambda: SepLLMPolicy(sinks=2, separators=3, recent=3, separator_ids=SEPARATORS),
    "sepllm-no-sinks": lambda: SepLLMPolicy(sinks=0, separators=5, recent=3, separator_ids=SEPARATORS),
    "roco": lambda: make_policy("roco", BUDGET, volatile=2, heavy=3, recent=3),
    "roco-no-volatile": lambda: make_policy("roco", BUDGET, volatile=0, recent=1),
    "snapkv": lambda: make_policy("snapkv", BUDGET, heavy=5, recent=3, observation=3, kernel=3),
    "snapkv-max-pool": lambda: make_policy("snapkv", BUDGET, heavy=6, recent=2, observation=4, kernel=3, max_pool=True),
    "pyramid": lambda: make_policy("pyramid", BUDGET, heavy=5, recent=3, observation=3, kernel=3, beta=2),
    "snapkv-no-pooling": lambda: make_policy("snapkv", BUDGET, heavy=4, recent=4, observation=1, kernel=1),
    "cam": lambda: make_policy("cam", BUDGET, sinks=2, merge_span=3),
    "cam-wide-span": lambda: make_policy("cam", BUDGET, sinks=1, merge_span=32, merge_seed=5),
    "scissorhands": lambda: make_policy("scissorhands", BUDGET, heavy=5, recent=3, history=4, quantile=0.75),
    "scissorhands-median": lambda: make_policy("scissorhands", BUDGET, heavy=7, recent=1, history=30, quantile=0.5),
    "keyformer": lambda: make_policy("keyformer", BUDGET, heavy=5, recent=3, tau_steps=40),
    "keyformer-hot": lambda: make_policy(
        "keyformer", BUDGET, heavy=6, recent=2, tau_init=0.5, tau_end=4.0, tau_steps=7, gumbel_seed=12345
    ),
}


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
def test_policy_variants_agree_with_the_oracle_on_streams_ten_times_the_budget(variant, kv_heads, rolling):
    spec = VARIANTS[variant]()
    cache = run_against_oracle(spec, kv_heads, rolling, steps=10 * BUDGET)
    kept = [tuple(layer.positions[0, h].tolist()) for layer in cache.layers for h in range(kv_heads)]
    if variant == "tova-per-head" and kv_heads > 1:
        assert len(set(kept)) > 1  # per KV head: heads chose differently somewhere
    if variant.startswith("sepllm"):
        # the entries kept between the sinks and the window are separators (the stream has plenty of them)
        stream = stream_for(spec, 10 * BUDGET, seed=kv_heads, vocab=VOCAB)[0].tolist()
        assert all(stream[p] in SEPARATORS for p in kept[0][spec.sinks : spec.sinks + spec.separators])


def test_the_oracle_comparison_can_fail():
    """An engine that breaks ties the other way (or forgets differently) is caught: a2sf at alpha 0.5 against an
    oracle that believes the factor is 1 (plain h2o) disagrees on what it keeps."""
    engine, believed = make_policy("a2sf", BUDGET, alpha=0.5), make_policy("a2sf", BUDGET, alpha=1.0)
    assert first_head_ever_differs(engine, believed, random_ids(10 * BUDGET, seed=2))
