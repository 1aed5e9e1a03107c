"""head_hybrid: retrieval heads rank by score, streaming heads keep their newest, at one budget; its classes given as
LAYER.HEAD pairs or by a classification file from `h2o-stream calibrate`, refused on a model they do not name."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import StreamingCache, make_policy
from h2o_stream.errors import H2OStreamError
from support.oracle import first_head_ever_differs, run_against_oracle
from support.tiny_models import random_ids, tiny_model

BUDGET = 8


def retrieval_for(kv_heads: int) -> str:
    """Layer 0's first KV head and layer 1's last: both classes in both layers of the tiny llama (2 layers)."""
    return f"0.0,1.{kv_heads - 1}"


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
@pytest.mark.parametrize("split", [dict(sinks=2, heavy=3), dict(sinks=0, heavy=5, recent=3)], ids=["sinks", "none"])
@pytest.mark.parametrize("every_layer", [False, True], ids=["pairs", "every-layer"])
def test_head_hybrid_agrees_with_the_oracle(kv_heads, rolling, split, every_layer):
    pairs = f"*.{kv_heads - 1}" if every_layer else retrieval_for(kv_heads)
    policy = make_policy("head_hybrid", BUDGET, retrieval_heads=pairs, **split)
    run_against_oracle(policy, kv_heads, rolling, steps=10 * BUDGET)


def test_a_streaming_head_keeps_what_sink_keeps_and_a_retrieval_head_what_h2o_sinks_keeps():
    """Head by head, the same entries as the two policies it mixes, run on the same stream."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(6 * BUDGET, seed=3)
    kept = {}
    for name, policy in {
        "hybrid": make_policy("head_hybrid", BUDGET, sinks=2, heavy=3, retrieval_heads="0.1,1.1"),
        "sink": make_policy("sink", BUDGET, sinks=2),
        "h2o_sinks": make_policy("h2o_sinks", BUDGET, sinks=2, heavy=3),
    }.items():
        cache = StreamingCache(model, policy)
        for t in range(ids.shape[1]):  # exact mode, one token a step
            model(ids[:, t : t + 1], cache=cache)
        kept[name] = [[layer.positions[0, h].tolist() for h in range(2)] for layer in cache.layers]
    for layer in range(2):
        assert kept["hybrid"][layer][0] == kept["sink"][layer][0]
        assert kept["hybrid"][layer][1] == kept["h2o_sinks"][layer][1]
    assert kept["sink"][0][1] != kept["h2o_sinks"][0][1]  # the classes made a difference


def test_no_retrieval_head_is_sink_at_the_same_budget():
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(5 * BUDGET, seed=4)
    logits, kept = [], []
    for policy in (make_policy("head_hybrid", BUDGET, retrieval_heads="none"), make_policy("sink", BUDGET)):
        cache = StreamingCache(model, policy)
        logits.append(torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(ids.shape[1])], 1))
        kept.append([layer.positions.tolist() for layer in cache.layers])
    assert kept[0] == kept[1]
    # the same entries; only the attention's arithmetic differs (explicit softmax for the scores, sink's fused kernel)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)


def test_the_oracle_sees_the_classes():
    """An engine whose heads were classed otherwise is caught."""
    engine = make_policy("head_hybrid", BUDGET, retrieval_heads="0.1")
    believed = make_policy("head_hybrid", BUDGET, retrieval_heads="0.0")
    assert first_head_ever_differs(engine, believed, random_ids(6 * BUDGET, seed=5))


@pytest.mark.parametrize(
    "pairs, message",
    [
        ("2.0", "layer 2 does not run head_hybrid on this model (the layers that do: 0, 1)"),
        ("1.2", "this model's layers have 2 KV head(s), 0..1"),
        ("*.3", "retrieval head *.3: this model's layers have 2 KV head(s)"),
    ],
)
def test_a_classification_naming_heads_the_model_lacks_is_refused_when_the_cache_is_made(pairs, message):
    model = tiny_model("llama", num_key_value_heads=2)
    with pytest.raises(H2OStreamError, match="retrieval head") as error:
        StreamingCache(model, make_policy("head_hybrid", BUDGET, retrieval_heads=pairs))
    assert message in str(error.value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "retrieval_heads must be given"),
        ("x", "must be LAYER.HEAD pairs"),
        ("1.0,-1.2", "must be LAYER.HEAD pairs"),
        ("0.1,0.1", "names a head twice"),
        ("missing.json", "no head classification file 'missing.json'"),
    ],
)
def test_bad_classifications_are_refused_when_the_policy_is_made(text, message):
    with pytest.raises(H2OStreamError, match=message):
        make_policy("head_hybrid", BUDGET, retrieval_heads=text)


def test_pairs_are_kept_in_one_spelling():
    policy = make_policy("head_hybrid", BUDGET, retrieval_heads=" 1.0, 0.3,0.1,*.2")
    assert policy.retrieval_heads == "*.2,0.1,0.3,1.0" and policy.calibrated_for == ""
    assert policy.retrieval_in(0) == (1, 2, 3) and policy.retrieval_in(1) == (0, 2) and policy.retrieval_in(2) == (2,)
