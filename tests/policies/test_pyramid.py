"""pyramid (PyramidKV): snapkv with a per-layer budget schedule. The schedule's arithmetic, each layer holding its
own budget in a stream, the same total memory as the budget in every layer, equality with snapkv where the schedule
is flat, sliding-window layers left to their window, and the refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from h2o_stream import H2OStreamError, StreamingCache, make_policy, stream_perplexity
from h2o_stream.engine.layer_types import layer_windows
from h2o_stream.engine.policies.declarations import pyramid_budgets
from support.oracle import stream_for
from support.policy_matrix import EVICTING, build
from support.tiny_models import VOCAB, random_ids, tiny_model


@pytest.mark.parametrize("ranked, layers, beta", [(224, 30, 20), (7, 2, 2), (100, 7, 3), (5, 4, 20), (64, 1, 20)])
def test_the_schedule_runs_from_twice_the_mean_down_to_a_beta_th_with_the_same_total(ranked, layers, beta):
    budgets = pyramid_budgets(ranked, layers, beta)
    assert len(budgets) == layers and sum(budgets) == layers * ranked
    assert budgets == sorted(budgets, reverse=True)  # the lowest layer keeps the most
    if layers > 1:
        assert budgets[0] == 2 * ranked - ranked // beta and budgets[-1] == ranked // beta
        steps = [a - b for a, b in itertools.pairwise(budgets)]
        assert max(steps) - min(steps) <= 1  # equal steps, up to rounding


def test_the_official_rounding_holds_more_than_the_mean_where_ours_holds_exactly_it():
    """KVCache-Factory rounds its step down: at cache 256 on 30 layers (recent 32, 224 ranked) its highest layer keeps
    31 heavy slots, and all layers together 4.5% more than 30 x 224; ours go down to 11 and add up to 30 x 224."""
    low = 224 // 20
    high = 2 * 224 - low
    step = (high - low) // 29
    official = [high - layer * step for layer in range(30)]
    ours = pyramid_budgets(224, 30, 20)
    assert official[0] == ours[0] == 437 and official[-1] == 31 and ours[-1] == 11
    assert sum(official) == 7020 and sum(ours) == 6720


def test_each_layer_holds_its_own_budget_and_all_of_them_the_budget_in_every_layer():
    model = tiny_model("llama", num_hidden_layers=4, init_std=0.2)
    policy = make_policy("pyramid", 16, recent=4, beta=3)  # 12 ranked: 20, 15, 9, 4 (+ 4 recent each)
    cache = StreamingCache(model, policy)
    ids = random_ids(120)
    for t in range(0, 120, 4):
        model(ids[:, t : t + 4], cache=cache)
    budgets = [layer.policy.budget for layer in cache.layers]
    assert budgets == [4 + b for b in pyramid_budgets(12, 4, 3)] and budgets[0] > budgets[-1]
    cache.settle()  # a fair chunk leaves its last cut (one entry) to the next chunk
    assert [layer.slots for layer in cache.layers] == budgets  # each layer cut to its own budget
    assert cache.entries == 4 * 16 and cache.slots == 16  # the same memory as 16 in every layer
    assert cache.max_keys_seen == budgets[0] + 1
    result = stream_perplexity(model, None, ids[0], policy=policy, chunk_size=4)
    assert result.settings["policy"] == "pyramid" and result.settings["beta"] == 3


@pytest.mark.parametrize("chunk", [1, 4], ids=["exact", "chunked"])
def test_a_flat_schedule_is_snapkv_token_for_token(chunk):
    """beta = 1 puts heavy slots in every layer (2H - H down to H): pyramid is then snapkv."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(96)
    runs = []
    for policy in (make_policy("pyramid", 12, recent=4, beta=1), make_policy("snapkv", 12, recent=4)):
        cache = StreamingCache(model, policy)
        logits = torch.cat([model(ids[:, i : i + chunk], cache=cache).logits for i in range(0, 96, chunk)], dim=1)
        runs.append((logits, [layer.positions for layer in cache.layers], cache.evicted))
    (flat, flat_kept, evicted), (snap, snap_kept, snap_evicted) = runs
    assert evicted > 0 and evicted == snap_evicted
    assert torch.equal(flat, snap) and all(torch.equal(a, b) for a, b in zip(flat_kept, snap_kept, strict=True))


def test_sliding_window_layers_keep_their_window_and_the_schedule_spreads_over_the_global_layers():
    model = tiny_model("gemma3_text")
    windows = layer_windows(model.config)
    cache = StreamingCache(model, make_policy("pyramid", 12, recent=4, beta=2))
    global_layers = [i for i, window in enumerate(windows) if window is None]
    assert len(global_layers) >= 1 and len(global_layers) < len(windows)
    budgets = [cache.layers[i].policy.budget for i in global_layers]
    assert budgets == [4 + b for b in pyramid_budgets(8, len(global_layers), 2)]
    for i, window in enumerate(windows):
        if window is not None:
            assert cache.layers[i].policy.name == "window"
    ids = random_ids(60)
    for t in range(0, 60, 3):
        model(ids[:, t : t + 3], cache=cache)
    cache.settle()
    assert [cache.layers[i].slots for i in global_layers] == budgets


def test_where_every_layer_slides_the_schedule_spreads_over_them_all_capped_at_the_window():
    model = tiny_model("mistral_sliding")
    window = layer_windows(model.config)[0]
    cache = StreamingCache(model, make_policy("pyramid", 5, recent=2, beta=3))  # 3 ranked: 5, 3, 1 (+ 2)
    assert [layer.policy.budget for layer in cache.layers] == [2 + b for b in pyramid_budgets(3, 3, 3)] == [7, 5, 3]
    assert window - 1 == 7
    wider = StreamingCache(model, make_policy("pyramid", 6, recent=2, beta=2))  # 4 ranked: 6, 4, 2 (+ 2)
    assert [layer.policy.budget for layer in wider.layers] == [7, 6, 4]  # the lowest capped at the window


def test_a_chunk_wider_than_the_smallest_layer_is_refused():
    model = tiny_model("llama", num_hidden_layers=3)
    cache = StreamingCache(model, make_policy("pyramid", 16, recent=2, beta=7))  # 14 ranked: 26, 14, 2 (+ 2)
    assert cache.max_chunk == 4
    model(random_ids(4), cache=cache)
    with pytest.raises(H2OStreamError, match=r"at most its smallest layer's budget \(4\)"):
        model(random_ids(5, seed=2), cache=cache)


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(beta=0), r"beta must be a whole number in \(0, 1000\], got 0"),
        (dict(beta=2.5), r"beta must be a whole number"),
        (dict(kernel=0), r"kernel must be an odd whole number in \(0, 4095\], got 0"),
        (dict(kernel=4), r"kernel must be an odd whole number"),
        (dict(observation=-1), r"observation \(0: the recent window's length\) must be a whole number"),
    ],
)
def test_bad_settings_are_refused(given, message):
    with pytest.raises(H2OStreamError, match=message):
        make_policy("pyramid", 64, **given)


def test_a_cache_too_small_to_spread_is_refused_when_the_layers_are_made():
    with pytest.raises(H2OStreamError, match="leaves its highest layer no slot at all"):
        StreamingCache(tiny_model("llama"), make_policy("pyramid", 1))


def test_in_steady_state_no_forward_rebuilds_a_rotation_table():
    """Every layer at its own slots asks for its own table lengths each forward; they are all kept (a table is
    rebuilt from the model's rotary module only when it is not), so once the layers are full no forward calls it."""
    model = tiny_model("llama", num_hidden_layers=12)
    cache = StreamingCache(model, make_policy("pyramid", 16, recent=4, beta=3))
    assert len({layer.policy.budget for layer in cache.layers}) >= 10
    ids = random_ids(200)
    calls = []
    handle = model.model.rotary_emb.register_forward_hook(lambda *args: calls.append(1))
    try:
        for t in range(0, 200, 4):
            model(ids[:, t : t + 4], cache=cache)
            if t == 120:
                calls.clear()  # warm: every layer full, every table made
    finally:
        handle.remove()
    forwards = (200 - 124) // 4
    assert len(calls) == forwards  # the model's own rotation of each forward's tokens, nothing more


@pytest.mark.parametrize("policy", EVICTING)
def test_every_policy_keeps_each_layer_within_its_budget_and_all_layers_within_cache_size_times_layers(policy):
    """What README.md and docs/design.md state: once settled, each layer holds at most its own budget per KV head
    (the cache size; pyramid's lowest layers more, its highest fewer), all layers together at most the cache size x
    the layers, and a query sees at most its layer's budget + 1 keys."""
    size, layers = 8, 3
    model = tiny_model("llama", num_hidden_layers=layers, num_key_value_heads=2, init_std=0.2)
    spec = build(policy, size)
    cache = StreamingCache(model, spec)
    ids = stream_for(spec, 6 * size, seed=1, vocab=VOCAB)
    for start in range(0, ids.shape[1], 3):
        model(ids[:, start : start + 3], cache=cache)
        cache.settle()
        budgets = [layer.policy.budget for layer in cache.layers]
        assert sum(budgets) == layers * size and all(layer.slots <= layer.policy.budget for layer in cache.layers)
        assert cache.entries <= layers * size and cache.slots <= size
    assert cache.seen > size and cache.evicted > 0
    assert cache.max_keys_seen <= max(budgets) + 1
    if spec.layer_schedule is not None:
        assert max(budgets) > size > min(budgets) and cache.max_keys_seen > size + 1  # the lowest layer sees more
