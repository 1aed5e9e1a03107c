"""The compiled exact-mode loop (engine/compiled.py): the same steps as the tensor operations, for every policy that
declares its one-entry cut (`EvictionPolicy.drop_one`), and the forwards that take it or do not."""

from __future__ import annotations

import copy

import pytest
import torch

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine import RowsCache, StreamingLayer
from h2o_stream.engine import compiled as compiled_module
from h2o_stream.engine.hooks import Extras, _layer_attention
from h2o_stream.engine.plan import LayerPlan
from h2o_stream.engine.policies.h2o import H2OPolicy
from h2o_stream.rope_rolling import RopeRoller
from support.oracle import run_against_oracle
from support.policy_matrix import EVICTING, build
from support.tiny_models import random_ids, tiny_model

BUDGET = 8
#: policy name -> how to build it, for every policy with a compiled cut (and settings the defaults do not reach)
COMPILED = {name: (lambda name=name: build(name, BUDGET)) for name in EVICTING if build(name, BUDGET).drop_one()}
COMPILED |= {
    "tova-per-head": lambda: make_policy("tova", BUDGET, per_head=True),
    "a2sf-alpha-0.5": lambda: make_policy("a2sf", BUDGET, alpha=0.5, heavy=5),
    "h2o-no-window": lambda: make_policy("h2o", BUDGET, heavy=BUDGET, recent=0),
    "sink-no-sinks": lambda: make_policy("sink", BUDGET, sinks=0),
}
TENSOR_ONLY = [name for name in EVICTING if build(name, BUDGET).drop_one() is None]


class UndeclaredH2O(H2OPolicy):
    """h2o's rule without its declared cut: whatever the registry holds, one policy the compiled loop cannot take."""

    def drop_one(self):
        return None


@pytest.fixture
def calls(monkeypatch):
    """How many times the compiled loop ran (one call per layer and forward)."""
    count = [0]
    run = compiled_module.exact_steps

    def counted(*args, **kwargs):
        count[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(compiled_module, "exact_steps", counted)
    return count


def streaming_attention_of(layer, query, key, value):
    """What the registered attention function computes for `layer` (one scanned block of one token)."""
    return _layer_attention(layer, query, key, value, 0.25, Extras())


def _decode(model, policy, ids, *, compiled, monkeypatch, rolling=True, forward=1, decide_every=None):
    """Feed `ids` `forward` tokens at a time with gradients off, on the compiled loop or the tensor operations;
    the logits of every forward and the cache."""
    monkeypatch.setenv("H2O_STREAM_COMPILED", "1" if compiled else "0")
    cache = StreamingCache(model, policy, rolling=rolling, decide_every=decide_every)
    logits = []
    with torch.no_grad():
        for start in range(0, ids.shape[1], forward):
            logits.append(model(ids[:, start : start + forward], cache=cache).logits[0])
    return torch.cat(logits), cache


def _same_caches(mine, theirs, atol):
    assert (mine.seen, mine.evicted, mine.max_keys_seen) == (theirs.seen, theirs.evicted, theirs.max_keys_seen)
    for a, b in zip(mine.layers, theirs.layers, strict=True):
        assert torch.equal(a.positions, b.positions)
        assert torch.allclose(a.keys, b.keys, atol=atol) and torch.allclose(a.values, b.values, atol=atol)
        assert (a.scores is None) == (b.scores is None)
        if a.scores is not None:
            assert torch.allclose(a.scores, b.scores, atol=atol)


@pytest.mark.parametrize("variant", sorted(COMPILED))
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_compiled_exact_mode_equals_the_tensor_operations(variant, kv_heads, rolling, dtype, calls, monkeypatch):
    """Token by token over ten budgets: the same kept entries (every layer and head), evictions and keys seen, and
    logits, keys and scores equal up to float rounding (the loop sums in its own order)."""
    model = tiny_model("llama", num_key_value_heads=kv_heads, init_std=0.2).to(dtype)
    ids = random_ids(10 * BUDGET, seed=kv_heads)
    policy = COMPILED[variant]()
    mine, mine_cache = _decode(model, policy, ids, compiled=True, rolling=rolling, monkeypatch=monkeypatch)
    assert calls[0] == ids.shape[1] * len(mine_cache.layers)
    theirs, theirs_cache = _decode(model, policy, ids, compiled=False, rolling=rolling, monkeypatch=monkeypatch)
    assert calls[0] == ids.shape[1] * len(mine_cache.layers)  # switched off: not one call more
    assert torch.allclose(mine, theirs, atol=2e-5, rtol=0)
    _same_caches(mine_cache, theirs_cache, atol=1e-5)
    assert mine_cache.evicted > 0


@pytest.mark.parametrize("variant", sorted(COMPILED))
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
def test_compiled_exact_mode_agrees_with_the_oracle(variant, kv_heads, rolling, calls):
    """The design's rules, written plainly (tests/support/oracle.py): logits within 1e-4 and the kept entries of every
    layer and head at every step, on the compiled loop (gradients off)."""
    with torch.no_grad():
        cache = run_against_oracle(COMPILED[variant](), kv_heads, rolling, steps=10 * BUDGET)
    assert calls[0] == cache.seen * len(cache.layers)


@pytest.mark.parametrize("variant", ["h2o", "tova", "a2sf-alpha-0.5", "h2o_sinks", "roco"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
def test_a_scanned_exact_forward_is_one_compiled_call_per_layer(variant, rolling, calls, monkeypatch):
    """`decide_every=1` (ppl --exact) in forwards of 13 tokens: one call per layer and forward, and the same as the
    tensor operations taking the blocks one by one."""
    forward = 13
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(10 * BUDGET, seed=3)
    policy = COMPILED[variant]()
    mine, mine_cache = _decode(
        model, policy, ids, compiled=True, forward=forward, decide_every=1, rolling=rolling, monkeypatch=monkeypatch
    )
    assert calls[0] == -(-ids.shape[1] // forward) * len(mine_cache.layers)
    theirs, theirs_cache = _decode(
        model, policy, ids, compiled=False, forward=forward, decide_every=1, rolling=rolling, monkeypatch=monkeypatch
    )
    assert torch.allclose(mine, theirs, atol=2e-5, rtol=0)
    _same_caches(mine_cache, theirs_cache, atol=1e-5)


@pytest.mark.parametrize("variant", ["h2o", "tova", "sink"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
def test_one_call_of_many_steps_equals_many_calls_of_one_bit_for_bit(variant, rolling):
    """The loop keeps its storage and rotated keys between calls: the same queries, keys and values as one call of
    40 steps or 40 calls of one step give the same outputs and entries to the last bit."""
    policy = COMPILED[variant]()
    model = tiny_model("llama", num_key_value_heads=2)
    table = RopeRoller.for_model(model).table(BUDGET + 1, torch.device("cpu"))
    tables = (table["cos"], table["sin_rh"], table["ucos"], table["usin_rh"]) if rolling else None
    generator = torch.Generator().manual_seed(17)
    query, keys, values = (torch.randn(1, heads, 40, 16, generator=generator) for heads in (4, 2, 2))
    empty = torch.empty(1, 2, 0, 16)
    rule, layer_mean = policy.drop_one(), policy.score_heads == "layer"
    runs = []
    for steps in (40, 1):
        space = compiled_module.Workspace.around(empty, empty, empty.long()[..., 0], None, BUDGET + 1, ())
        held, outputs = 0, []
        for start in range(0, 40, steps):
            block = slice(start, start + steps)
            output, held, _, _ = compiled_module.exact_steps(
                space,
                held,
                query[:, :, block],
                keys[:, :, block],
                values[:, :, block],
                tables,
                scaling=0.25,
                seen=start,
                budget=BUDGET,
                rule=rule,
                layer_mean=layer_mean,
            )
            outputs.append(output)
        runs.append((torch.cat(outputs, dim=1), space.hand_out(held, rule.ranked)))
    (one_call, entries), (many_calls, their_entries) = runs
    assert torch.equal(one_call, many_calls)
    for mine, theirs in zip(entries, their_entries, strict=True):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)


@pytest.mark.parametrize("variant", sorted(COMPILED) + ["roco-volatile-4"])
@pytest.mark.parametrize("queries", ["zero", "random", "deaf"])
def test_ties_and_steps_at_the_layer_go_as_on_the_tensor_operations(variant, queries):
    """One layer, holding a full budget of entries with equal scores, fed the same queries, keys and values step by
    step on both paths. Zero queries attend uniformly, so those scores stay tied (and tova's tie everywhere). "deaf":
    without rolling, one key in four faces the (large) queries and the others face away, so far that they receive
    exactly 0: their scores (and roco's means and variances) tie at 0, and more volatile slots than live keys spare
    tied entries too. The loop must drop the entry `keep` leaves out, of equal lowest the newest."""
    policy = (
        make_policy("roco", BUDGET, volatile=4, heavy=1, recent=3)
        if variant == "roco-volatile-4"
        else COMPILED[variant]()
    )
    roller = RopeRoller.for_model(tiny_model("llama", num_key_value_heads=2)) if queries != "deaf" else None
    generator = torch.Generator().manual_seed(19)
    steps = 6 * BUDGET
    query = torch.randn(1, 4, steps, 16, generator=generator) * (queries == "random")
    keys, values = (torch.randn(1, 2, BUDGET + steps, 16, generator=generator) for _ in range(2))
    if queries == "deaf":
        facing = torch.ones(16) / 4
        query = 80 * facing.expand(1, 4, steps, 16)
        keys = (torch.arange(BUDGET + steps) % 4 == 1).float().mul(2).sub(1)[None, None, :, None] * 8 * facing
        keys = keys.expand(1, 2, -1, -1)
    held = {
        "keys": keys[:, :, :BUDGET],
        "values": values[:, :, :BUDGET],
        "seen": BUDGET,
        "evicted": 0,
        "positions": torch.arange(BUDGET).expand(1, 2, BUDGET),
        "max_keys": BUDGET,
        "scores": torch.zeros(1, 2, BUDGET, *policy.score_moments, dtype=torch.float64),
    }
    layers = [StreamingLayer(policy, roller) for _ in range(2)]
    for layer in layers:
        layer.load_state(dict(held))
    keys, values = keys[:, :, BUDGET:], values[:, :, BUDGET:]
    for t in range(steps):
        outputs = []
        for layer, compiled in zip(layers, (True, False), strict=True):
            layer.begin(LayerPlan(1, (1,), compiled=compiled))
            key, value = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            outputs.append(streaming_attention_of(layer, query[:, :, t : t + 1], key, value))
        mine, theirs = layers
        assert torch.equal(mine.positions, theirs.positions), t
        assert torch.allclose(outputs[0], outputs[1], atol=1e-6)
    assert mine.evicted == theirs.evicted > 0


def test_a_pending_cut_and_a_prompt_before_compiled_steps(calls, monkeypatch):
    """A fair chunk (its last cut left pending) and then single tokens; a wide prompt into an empty cache and then
    single tokens: the compiled steps first settle what the tensor operations would have."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(6 * BUDGET, seed=5)
    for policy in (make_policy("h2o", BUDGET), make_policy("tova", BUDGET)):
        results = []
        for compiled in (True, False):
            monkeypatch.setenv("H2O_STREAM_COMPILED", "1" if compiled else "0")
            fair = StreamingCache(model, policy)
            prompt = StreamingCache(model, policy, wide_chunks=True)
            logits = []
            with torch.no_grad():
                logits.append(model(ids[:, :12], cache=prompt).logits[0])
                for start in range(0, 16, 4):
                    logits.append(model(ids[:, start : start + 4], cache=fair).logits[0])
                assert fair.layers[0].cut_pending
                for t in range(16, ids.shape[1]):
                    logits.append(model(ids[:, t : t + 1], cache=fair).logits[0])
                    logits.append(model(ids[:, t - 4 : t - 3], cache=prompt).logits[0])
            results.append((torch.cat(logits), fair, prompt))
        (mine, *mine_caches), (theirs, *theirs_caches) = results
        assert torch.allclose(mine, theirs, atol=2e-5, rtol=0)
        for a, b in zip(mine_caches, theirs_caches, strict=True):
            _same_caches(a, b, atol=1e-5)
    assert calls[0] > 0


def test_a_cache_loaded_from_a_snapshot_goes_on_as_the_original(calls):
    """The loop keeps its storage between forwards; a cache given another's snapshot must not read stale storage
    (its own or the original's): both go on alike, bit for bit."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(6 * BUDGET, seed=7)
    policy = make_policy("h2o", BUDGET)
    original, copy = StreamingCache(model, policy), StreamingCache(model, policy)
    with torch.no_grad():
        for t in range(3 * BUDGET):
            model(ids[:, t : t + 1], cache=original)
            model(ids[:, -1 - t : ids.shape[1] - t], cache=copy)  # different entries, its storage in use
        copy.load_state(original.state())
        for t in range(3 * BUDGET, ids.shape[1]):
            mine = model(ids[:, t : t + 1], cache=original).logits
            theirs = model(ids[:, t : t + 1], cache=copy).logits
            assert torch.equal(mine, theirs)
    _same_caches(original, copy, atol=0)
    assert calls[0] > 0


def test_a_deep_copy_goes_on_as_the_original(calls):
    """copy.deepcopy of a cache between compiled forwards (a user's fork): the copy and the original go on as a cache
    never copied, in what they return and in what they hold."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(6 * BUDGET, seed=3)
    reference, original = (StreamingCache(model, make_policy("h2o", BUDGET)) for _ in range(2))
    for t in range(3 * BUDGET):
        model(ids[:, t : t + 1], cache=reference)
        model(ids[:, t : t + 1], cache=original)
    fork = copy.deepcopy(original)
    for t in range(3 * BUDGET, ids.shape[1]):
        expected = model(ids[:, t : t + 1], cache=reference).logits
        for cache in (original, fork):
            assert torch.equal(model(ids[:, t : t + 1], cache=cache).logits, expected)
    for cache in (original, fork):
        _same_caches(cache, reference, atol=0)
    assert calls[0] > 0


def test_rows_of_one_forward_each_take_the_compiled_steps(calls, monkeypatch):
    """A RowsCache of exact-mode rows (h2o and tova side by side): each row as its cache alone."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(5 * BUDGET, seed=9)
    policies = [make_policy("h2o", BUDGET), make_policy("tova", BUDGET)]
    rows = [StreamingCache(model, policy) for policy in policies]
    both = RowsCache(model, rows)
    with torch.no_grad():
        batched = torch.cat(
            [model(ids[:, t : t + 1].expand(2, -1), cache=both).logits for t in range(ids.shape[1])], dim=1
        )
    for i, policy in enumerate(policies):
        alone, alone_cache = _decode(model, policy, ids, compiled=False, monkeypatch=monkeypatch)
        assert torch.allclose(batched[i], alone, atol=2e-5, rtol=0)
        _same_caches(rows[i], alone_cache, atol=1e-5)
    assert calls[0] > 0


@pytest.mark.parametrize("case", ["chunk", "gradients", "float16", "switched-off", "tensor-only policy"])
def test_forwards_that_are_not_exact_steps_stay_on_the_tensor_operations(case, calls, monkeypatch):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(3 * BUDGET, seed=11)
    policy = make_policy("h2o", BUDGET)
    if case == "float16":
        model = model.to(torch.float16)
    if case == "switched-off":
        monkeypatch.setenv("H2O_STREAM_COMPILED", "0")
    tensor_only = [build(name, BUDGET) for name in TENSOR_ONLY] + [UndeclaredH2O(heavy=4, recent=4)]
    caches = [StreamingCache(model, spec) for spec in (tensor_only if case == "tensor-only policy" else [policy])]
    with torch.set_grad_enabled(case == "gradients"):
        for cache in caches:
            for start in range(0, ids.shape[1], 4 if case == "chunk" else 1):
                model(ids[:, start : start + (4 if case == "chunk" else 1)], cache=cache)
            assert cache.evicted > 0
    assert calls[0] == 0


@pytest.mark.parametrize("variant", sorted(COMPILED))
def test_a_declared_cut_drops_what_keep_drops(variant):
    """The declaration against the policy's own `keep`, with tied scores (integers): holding budget + 1, the one
    slot `keep` leaves out is the lowest score between the protected slots, of equal lowest the newest (or, not
    ranked, the oldest unprotected)."""
    policy = COMPILED[variant]()
    rule = policy.drop_one()
    n = policy.budget + 1
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        scores = torch.randint(0, 3, (2, 3, n, *policy.score_moments), generator=generator).double()
        positions = torch.arange(n).expand(2, 3, n) + 100
        kept = policy.keep(positions, scores if policy.needs_scores else None)
        for b in range(2):
            for h in range(3):
                left_out = sorted(set(range(n)) - set(kept[b, h].tolist()))
                candidates = list(range(rule.sinks, n - rule.recent))
                ranks = scores[b, h].tolist()
                if rule.by_mean:  # roco: mean and variance over the age; the most volatile are spared
                    age = [positions[b, h, -1].item() - positions[b, h, j].item() + 1 for j in range(n)]
                    mean = [ranks[j][0] / age[j] for j in range(n)]
                    variance = [ranks[j][1] / age[j] - mean[j] ** 2 for j in range(n)]
                    spared = sorted(candidates, key=lambda j: (-variance[j], j))[: rule.volatile]
                    candidates = [j for j in candidates if j not in spared]
                    ranks = mean
                if rule.ranked:
                    lowest = min(ranks[j] for j in candidates)
                    expected = max(j for j in candidates if ranks[j] == lowest)
                else:
                    expected = rule.sinks
                assert left_out == [expected]
