"""Fair chunked mode: no query of a chunk sees more than budget + 1 keys, for every policy (docs/design.md)."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine import default_chunk_size, hooks
from h2o_stream.errors import H2OStreamError
from support.oracle import Oracle, stream_for
from support.policy_matrix import BANDED, EVICTING, TOKENIZER, build
from support.tiny_models import VOCAB, random_ids, tiny_model

UNBANDED = [name for name in EVICTING if name not in BANDED]


@pytest.mark.parametrize("policy", UNBANDED)
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
@pytest.mark.parametrize("chunk", [3, 5])
def test_fair_chunks_agree_with_the_oracle(policy, kv_heads, rolling, chunk):
    """Logits of every token (1e-4) and the kept entries of every layer and head after every chunk, on a stream ten
    times the budget, against the oracle's statement of fair chunks. A policy whose cuts nest leaves a chunk's last
    cut to the next chunk's: every other chunk is left so (its logits still checked), the others are settled first."""
    budget = 8
    spec = build(policy, budget)
    model = tiny_model("llama", num_key_value_heads=kv_heads, init_std=0.2)
    oracle = Oracle.for_policy(model, spec, rolling=rolling)
    cache = StreamingCache(model, spec, rolling=rolling)
    ids = stream_for(spec, 10 * budget, seed=kv_heads + chunk, vocab=VOCAB)
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start : start + chunk]
        engine_logits = model(piece, cache=cache).logits[0]
        oracle_logits = oracle.chunk(piece[0].tolist())
        assert torch.allclose(engine_logits, oracle_logits, atol=1e-4, rtol=0), f"chunk at {start}"
        if (start // chunk) % 2:
            assert all(layer.slots <= layer.policy.budget + 1 for layer in cache.layers)
            continue  # any pending cut stays for the next chunk's make_room
        cache.settle()
        for layer_idx, layer in enumerate(cache.layers):
            for head in range(kv_heads):
                assert layer.positions[0, head].tolist() == oracle.kept_positions(layer_idx, head), (start, layer_idx)
    assert cache.evicted > 0
    assert cache.max_keys_seen == widest_budget(cache) + 1


def widest_budget(cache) -> int:
    """The largest budget of a layer: the cache's budget, or with a per-layer schedule (pyramid) its lowest layer's."""
    return max(policy.budget for policy in cache.layer_policies)


@pytest.mark.parametrize("policy", EVICTING)
def test_no_query_sees_more_than_budget_plus_one_keys(policy, monkeypatch):
    """Counted where attention runs, not by the cache's own bookkeeping: the widest key set a query is given."""
    widest = []
    for name in ("attend", "attend_with_sink_queries"):
        kernel = getattr(hooks, name)

        def counting(query, key, value, mask, *args, _kernel=kernel, **kwargs):
            widest.append(_widest_row(mask, query.shape[-2], key.shape[-2]))
            return _kernel(query, key, value, mask, *args, **kwargs)

        monkeypatch.setattr(hooks, name, counting)
    sdpa = hooks.F.scaled_dot_product_attention

    def counting_sdpa(query, key, value, attn_mask=None, **kwargs):
        widest.append(_widest_row(attn_mask, query.shape[-2], key.shape[-2]))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(hooks.F, "scaled_dot_product_attention", counting_sdpa)
    model = tiny_model("llama")
    budget, chunk = 16, 8
    cache = StreamingCache(model, build(policy, budget))
    ids = random_ids(80)
    for start in range(0, 80, chunk):
        model(ids[:, start : start + chunk], cache=cache)
    assert max(widest) == widest_budget(cache) + 1
    assert cache.max_keys_seen == widest_budget(cache) + 1


def _widest_row(mask, q_len: int, k_len: int) -> int:
    """The most keys one query row may attend to (no mask: causal, so the last row sees all k_len)."""
    if mask is None:
        return k_len
    if mask.dtype == torch.bool:
        return int(mask.sum(dim=-1).max())
    return int((mask > float("-inf")).sum(dim=-1).max())


@pytest.mark.parametrize("policy", UNBANDED)
def test_wide_chunks_let_queries_see_the_cache_plus_the_chunk(policy):
    model = tiny_model("llama")
    budget, chunk = 16, 8
    fair = StreamingCache(model, build(policy, budget))
    wide = StreamingCache(model, build(policy, budget), wide_chunks=True)
    ids = random_ids(64)
    outputs = {}
    for name, cache in (("fair", fair), ("wide", wide)):
        outputs[name] = torch.cat([model(ids[:, s : s + chunk], cache=cache).logits[0] for s in range(0, 64, chunk)])
    assert wide.max_keys_seen == widest_budget(wide) + chunk and fair.max_keys_seen == widest_budget(fair) + 1
    assert not torch.allclose(outputs["fair"][chunk * 3 :], outputs["wide"][chunk * 3 :])
    # the same until the first fair cut: before the first chunk that finds more than budget + 1 - chunk entries (the
    # smallest layer's budget, with a per-layer schedule); at 16 and chunks of 8, the first 16 tokens
    narrowest = min(policy.budget for policy in fair.layer_policies)
    same = chunk * (1 + (narrowest + 1 - chunk) // chunk)
    assert torch.equal(outputs["fair"][:same], outputs["wide"][:same])


@pytest.mark.parametrize("policy", BANDED + ["full"])
def test_band_policies_and_the_full_cache_are_untouched_by_fairness(policy):
    model = tiny_model("llama")
    ids = random_ids(64)
    logits = {}
    for wide in (False, True):
        cache = StreamingCache(model, build(policy, 16), wide_chunks=wide)
        logits[wide] = torch.cat([model(ids[:, s : s + 8], cache=cache).logits[0] for s in range(0, 64, 8)])
    assert torch.equal(logits[False], logits[True])


@pytest.mark.parametrize("policy", UNBANDED)
def test_reduced_policy_shrinks_every_part_but_the_sinks_in_proportion(policy):
    spec = build(policy, 64)
    full = spec.split()
    others = {name: value for name, value in full.items() if name != "sinks"}
    for budget in (63, 40, 17, 5, 1):
        smaller = spec.reduced(budget)
        split = smaller.split()
        assert type(smaller) is type(spec) and smaller.budget == budget
        cut = spec.budget - budget
        if cut <= sum(others.values()):
            assert split.get("sinks") == full.get("sinks"), split
            for name, value in others.items():
                share = cut * value / sum(others.values())
                assert abs((value - split[name]) - share) < 1, (name, split)
        else:
            assert all(split[name] == 0 for name in others) and split["sinks"] == budget, split
        assert {k: v for k, v in vars(smaller).items() if k not in full} == {
            k: v for k, v in vars(spec).items() if k not in full
        }
    with pytest.raises(H2OStreamError, match="cannot be reduced"):
        spec.reduced(0)


def test_an_unbounded_policy_cannot_be_reduced():
    # it has no budget to reduce: the refusal, not a TypeError comparing with None
    with pytest.raises(H2OStreamError, match=r"full\(\) cannot be reduced to 1 slots"):
        make_policy("full").reduced(1)


def test_default_chunk_size_is_a_sixteenth_of_the_budget_unless_a_band_makes_chunks_exact():
    assert default_chunk_size(make_policy("h2o", 256)) == 16
    assert default_chunk_size(make_policy("roco", 512, recent=40)) == 1  # its share is 0: exact mode (compiled)
    assert default_chunk_size(make_policy("sepllm", 512, tokenizer=TOKENIZER)) == 32
    assert default_chunk_size(make_policy("h2o", 15)) == 1
    assert default_chunk_size(make_policy("sink", 128)) == 256
    assert default_chunk_size(make_policy("full")) == 256


def test_a_default_chunk_never_shields_more_than_the_recent_window_would():
    """A chunk's own tokens escape every cut until it ends; exact mode spares only the last `recent` entries. So the
    default chunk is at most the largest power of two up to recent + 1: tova (no window) runs exact mode."""
    assert default_chunk_size(make_policy("tova", 512)) == 1
    assert default_chunk_size(make_policy("keydiff", 512, recent=40)) == 32  # 41 -> 32, the sixteenth of 512
    assert default_chunk_size(make_policy("h2o", 256, recent=7)) == 8
    assert default_chunk_size(make_policy("h2o", 256, recent=6)) == 4
    assert default_chunk_size(make_policy("keydiff", 256, recent=0)) == 1


def test_chat_and_summarize_read_prompts_in_wide_chunks(model, tokenizer):
    """Generation reads a prompt as well as it can: every prompt token sees all the cache holds (a fair cut before a
    chunk as wide as the cache would leave one entry to read from)."""
    from h2o_stream.apps.chat import ChatSession
    from h2o_stream.apps.summarize.reader import Reader

    for cache in (
        ChatSession(model, tokenizer, policy=make_policy("h2o", 16)).cache,
        Reader(model, tokenizer, policy="h2o", cache_size=16, chunk_size=16).new_cache(),
    ):
        ids = random_ids(48) % len(tokenizer)
        for start in range(0, 48, 16):
            model(ids[:, start : start + 16], cache=cache)
        assert not cache.fair and cache.max_keys_seen == 32


def test_a_policy_declares_its_share_of_the_budget_as_its_fair_chunk():
    from h2o_stream.engine.policies.h2o import H2OPolicy

    class Finer(H2OPolicy):  # not registered: only its declaration matters here
        fair_chunk_share = 1 / 32

    assert default_chunk_size(Finer(heavy=128, recent=128)) == 8
    assert default_chunk_size(H2OPolicy(heavy=128, recent=128)) == 16


@pytest.mark.parametrize("policy", UNBANDED)
@pytest.mark.parametrize("scanned", [False, True], ids=["chunk-per-forward", "scanned"])
def test_a_cut_left_to_the_next_chunk_keeps_what_cutting_at_once_keeps(policy, scanned):
    """A fair chunk leaves its last cut (budget + 1 -> budget) to the next chunk's (nesting policies: one cut with the
    reduced policy; the others, keydiff: both at once, `keep_twice`);
    the same stream with the cache settled after every forward (each cut made at once) gives the same logits bit for
    bit, the same kept entries and the same eviction count."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = stream_for(build(policy, 8), 80, seed=3, vocab=VOCAB)
    width, decide_every = (20, 5) if scanned else (5, None)
    runs, pending_seen = [], False
    for settle in (False, True):
        cache = StreamingCache(model, build(policy, 8), decide_every=decide_every)
        logits = []
        for start in range(0, ids.shape[1], width):
            logits.append(model(ids[:, start : start + width], cache=cache).logits)
            pending_seen = pending_seen or any(layer.cut_pending for layer in cache.layers)
            if settle:
                cache.settle()
                assert not any(layer.cut_pending for layer in cache.layers)
        runs.append((torch.cat(logits, 1), cache))
    (left, left_cache), (settled, settled_cache) = runs
    assert pending_seen and torch.equal(left, settled)
    assert left_cache.evicted == settled_cache.evicted > 0  # reading evicted settles the first cache too
    for mine, theirs in zip(left_cache.layers, settled_cache.layers, strict=True):
        assert torch.equal(mine.positions, theirs.positions) and torch.equal(mine.keys, theirs.keys)
        assert mine.slots == theirs.slots == mine.policy.budget


@pytest.mark.parametrize("policy", ["h2o", "scissorhands", "keydiff", "sepllm", "cam", "tova"])
@pytest.mark.parametrize("decide_every", [None, 3], ids=["chunks", "scanned"])
def test_a_chunk_filling_the_room_its_cut_left_equals_one_concatenating(policy, decide_every, monkeypatch):
    """A fair chunk's cut gathers into tensors with room for the chunk, which its append fills in place: the same
    logits, entries and scores bit for bit as concatenating the chunk onto what the cut kept."""
    from h2o_stream.engine.layer import StreamingLayer

    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(70)
    fills = StreamingLayer._fills
    filled = []

    def counted(layer, room, slots):
        filled.append(fills(layer, room, slots))
        return filled[-1]

    runs = []
    for in_place in (True, False):
        monkeypatch.setattr(StreamingLayer, "_fills", counted if in_place else lambda *_: False)
        cache = StreamingCache(model, build(policy, 16), decide_every=decide_every)
        chunk = 6 if decide_every is None else 9
        with torch.no_grad():
            logits = torch.cat([model(ids[:, s : s + chunk], cache=cache).logits for s in range(0, 70, chunk)], dim=1)
        runs.append((logits, [layer.state() for layer in cache.layers]))
    assert any(filled)
    (logits, states), (concatenated, concatenated_states) = runs
    assert torch.equal(logits, concatenated)
    for state, other in zip(states, concatenated_states, strict=True):
        assert state.keys() == other.keys()
        for name, value in state.items():
            assert torch.equal(value, other[name]) if torch.is_tensor(value) else value == other[name]
