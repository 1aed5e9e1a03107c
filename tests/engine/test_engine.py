"""Exact mode against plain transformers and against the oracle written from DESIGN.md."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine.layer_types import layer_windows
from h2o_stream.engine.policies import POLICIES
from support.oracle import run_against_oracle
from support.policy_matrix import ALL, EVICTING, build
from support.tiny_models import FAMILIES, random_ids, tiny_model


def stream_logits(model, cache, ids, chunk=1):
    return torch.cat([model(ids[:, i : i + chunk], cache=cache).logits[0] for i in range(0, ids.shape[1], chunk)])


#: families whose every layer slides (a window shorter than the streams here): each layer runs the policy capped at
#: its window (docs/design.md), which keeps the model's own window only for a policy that keeps the newest entries
EVERY_LAYER_SLIDES = {"mistral_sliding"}


@pytest.mark.parametrize(
    "family, policy",
    [
        (family, policy)
        for family in sorted(FAMILIES)
        for policy in ALL
        if (family not in EVERY_LAYER_SLIDES or policy in ("full", "window"))
        and POLICIES[policy].layer_schedule is None
    ],
)  # (its budget is a mean)
def test_budget_covering_stream_reproduces_plain_forward(family, policy):
    model = tiny_model(family)
    ids = random_ids(48)
    reference = model(ids, cache=DynamicCache(config=model.config)).logits[0]
    cache = StreamingCache(model, build(policy, 64))  # a policy without parts (full) ignores the size
    logits = stream_logits(model, cache, ids)
    assert torch.allclose(logits, reference, atol=1e-5, rtol=0), (logits - reference).abs().max()
    # the budget covers the stream: only a sliding layer whose window is shorter than the stream cuts (what that
    # window no longer shows the model either)
    windows = layer_windows(model.config)
    assert [layer.evicted > 0 for layer in cache.layers] == [w is not None and w < ids.shape[1] for w in windows]


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "llama_yarn"])
def test_without_rolling_budget_covering_stream_reproduces_plain_forward(family):
    model = tiny_model(family)
    ids = random_ids(40)
    reference = model(ids).logits[0]
    logits = stream_logits(model, StreamingCache(model, make_policy("h2o", 64), rolling=False), ids)
    assert torch.allclose(logits, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("policy", EVICTING)  # a policy without rules in tests/support/oracle.py fails here
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
def test_engine_agrees_with_oracle_on_streams_ten_times_the_budget(policy, kv_heads, rolling):
    budget = 8
    spec = build(policy, budget)
    cache = run_against_oracle(spec, kv_heads, rolling, steps=10 * budget)  # also asserts that eviction happened
    # The test is only meaningful if, for policies that decide per KV head from scores or keys, heads chose
    # differently somewhere (one that decides per layer keeps the same entries in every head; one that ranks by
    # age and reads attention only to merge, cam, keeps the same entries everywhere).
    per_head = (spec.needs_scores or spec.needs_keys) and spec.score_heads == "kv" and spec.ranking.ranks_entries
    if per_head and kv_heads > 1:
        kept = [tuple(layer.positions[0, h].tolist()) for layer in cache.layers for h in range(kv_heads)]
        assert len(set(kept)) > 1
    if spec.score_heads == "layer":
        assert all(
            torch.equal(layer.positions[:, :1].expand_as(layer.positions), layer.positions) for layer in cache.layers
        )


@pytest.mark.parametrize("policy", [name for name in EVICTING if POLICIES[name].layer_schedule is None])
def test_cache_tensors_stop_growing_at_the_budget(policy):  # pyramid's per layer: tests/policies/test_pyramid.py
    model = tiny_model("llama")
    cache = StreamingCache(model, build(policy, 12))
    ids = random_ids(60)
    shapes = []
    for t in range(ids.shape[1]):
        model(ids[:, t : t + 1], cache=cache)
        layer = cache.layers[0]
        scores = None if layer.scores is None else layer.scores.shape  # a policy without scores carries none
        shapes.append((layer.keys.shape, layer.values.shape, layer.positions.shape, scores))
    assert all(s == shapes[11] for s in shapes[11:])
    assert shapes[11][0][-2] == 12 and cache.slots == 12 and cache.seen == 60
    assert cache.evicted == (60 - 12) * len(cache.layers) * cache.layers[0].keys.shape[1]


def test_generate_with_full_cache_matches_dynamic_cache():
    model = tiny_model("qwen2")
    prompt = random_ids(12)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False, cache=DynamicCache(config=model.config))
    got = model.generate(prompt, max_new_tokens=30, do_sample=False, cache=StreamingCache(model, make_policy("full")))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("policy", EVICTING)
def test_generate_with_eviction_matches_a_manual_greedy_loop(policy):
    model = tiny_model("llama", init_std=0.2)
    prompt = random_ids(20)
    got = model.generate(prompt, max_new_tokens=40, do_sample=False, cache=StreamingCache(model, build(policy, 16)))
    cache = StreamingCache(model, build(policy, 16))
    tokens = prompt
    logits = model(prompt, cache=cache).logits[:, -1]
    for _ in range(40):
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=-1)
        logits = model(tokens[:, -1:], cache=cache).logits[:, -1]
    assert torch.equal(got, tokens)
    assert cache.slots == 16


def test_rolling_keeps_positions_inside_the_cache():
    model = tiny_model("llama", max_position_embeddings=40)
    cache = StreamingCache(model, make_policy("sink", 32))
    seen_positions = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: seen_positions.append(int(kw["position_ids"].max())), with_kwargs=True
    )
    try:
        stream_logits(model, cache, random_ids(200))
    finally:
        hook.remove()
    # a stream 5x the model's context never asks for a position beyond budget (the query's slot)
    assert max(seen_positions) == 32


def test_an_attached_model_still_runs_plain_caches():
    model = tiny_model("llama")
    ids = random_ids(20)
    before = model(ids).logits
    stream_logits(model, StreamingCache(model, make_policy("h2o", 8)), ids)
    assert torch.equal(model(ids).logits, before)


def _inference_mode_per_layer(model) -> tuple[list[bool], object]:
    """Whether each decoder layer ran under inference mode (a list filled as the model runs), and the hook handles."""
    seen = []
    handles = [
        layer.register_forward_hook(lambda m, a, out: seen.append(torch.is_inference_mode_enabled()))
        for layer in model.model.layers
    ]
    return seen, handles


def test_a_forward_with_gradients_off_runs_in_inference_mode_and_returns_ordinary_logits():
    model = tiny_model("llama")
    cache = StreamingCache(model, make_policy("h2o", 8))
    seen, handles = _inference_mode_per_layer(model)
    try:
        for i in range(12):  # past the budget: cuts and in-place score updates included
            logits = model(random_ids(12)[:, i : i + 1], cache=cache).logits
        with torch.enable_grad():  # gradients on: no inference mode
            model(random_ids(13)[:, 12:], cache=cache)
    finally:
        for handle in handles:
            handle.remove()
    layers = len(model.model.layers)
    assert seen == [True] * (12 * layers) + [False] * layers
    assert not torch.is_inference_mode_enabled()  # left after each forward
    assert cache.layers[0].keys.is_inference() is False  # the last forward, gradients on, made ordinary tensors
    assert not logits.is_inference()  # the LM head runs after the base model's hooks: the caller may change them
    logits.add_(1)


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize(
    "chunk, decide_every, rolling",
    [(1, None, True), (4, None, True), (12, 4, True), (4, None, False)],
    ids=["exact", "chunked", "scanned", "chunked-no-rolling"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["tensor-ops", "compiled"])
def test_a_cache_goes_on_alike_through_forwards_with_gradients_on_and_off(
    policy, chunk, decide_every, rolling, compiled, monkeypatch
):
    """A forward with gradients on (a model whose weights require grad) after ones with them off (inference mode)
    may use everything the engine kept (memoised masks, tables, rows, the compiled loop's storage, and its scores),
    and the stream goes on as if every forward had had gradients off: bit for bit on the tensor operations; with the
    compiled exact-mode loop, which forwards with gradients on do not take, up to float rounding."""
    monkeypatch.setenv("H2O_STREAM_COMPILED", "1" if compiled else "0")
    model = tiny_model("llama")
    ids = random_ids(60)

    def cache():
        return StreamingCache(model, build(policy, 12), rolling=rolling, decide_every=decide_every)

    reference = stream_logits(model, cache(), ids, chunk)
    mixed = cache()
    pieces = [stream_logits(model, mixed, ids[:, :24], chunk)]
    with torch.enable_grad():
        pieces.append(stream_logits(model, mixed, ids[:, 24:48], chunk).detach())
    pieces.append(stream_logits(model, mixed, ids[:, 48:], chunk))
    if compiled:
        assert torch.allclose(torch.cat(pieces), reference, atol=2e-5, rtol=0)
    else:
        assert torch.equal(torch.cat(pieces), reference)


def test_a_refused_or_failing_forward_leaves_inference_mode():
    model = tiny_model("llama")
    cache = StreamingCache(model, make_policy("h2o", 8))
    model(random_ids(4), cache=cache)
    with pytest.raises(Exception, match="batch"):
        model(random_ids(4).repeat(2, 1), cache=cache)  # refused by the cache before the model runs
    assert not torch.is_inference_mode_enabled()

    def fail(module, args, output):
        raise RuntimeError("layer failed")

    handle = model.model.layers[0].register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="layer failed"):
            model(random_ids(5)[:, 4:], cache=cache)
    finally:
        handle.remove()
    assert not torch.is_inference_mode_enabled()
