"""What the engine refuses: each case is one clear H2OStreamError raised before the model runs, with the cache left as
it was (so the caller can go on), where it used to be a reshape or index error, or silently wrong numbers.

- a score-based policy (h2o) fed a chunk wider than its cache on top of cached entries (its numbers were meaningless:
  a 1-entry h2o cache "beat" every other policy);
- padded batches (the band mask replaced the padding mask; scores and positions counted padding as tokens);
- a cache used on another model, after a batch-size change, or by `model.generate` given a prompt the cache holds;
- without rolling, stream positions past the model's context (an IndexError inside the model before).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from h2o_stream import H2OStreamError, StreamingCache, make_policy
from h2o_stream.engine.feed import feed
from h2o_stream.engine.policies import POLICIES
from support.cache_state import assert_untouched, snapshot
from support.policy_matrix import ALL, BANDED, EVICTING, SCORED, build
from support.tiny_models import VOCAB, random_ids, tiny_model

#: scored policies with one budget in every layer (pyramid's layers differ: tests/policies/test_pyramid.py)
UNIFORM_SCORED = [name for name in SCORED if POLICIES[name].layer_schedule is None]


def refused(call, match: str):
    with pytest.raises(H2OStreamError, match=match) as info:
        call()
    return str(info.value)


# -- chunked h2o with a chunk wider than the cache ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", UNIFORM_SCORED)
def test_a_scored_cache_refuses_a_chunk_wider_than_itself_on_top_of_entries(policy):
    model = tiny_model("llama")
    cache = StreamingCache(model, build(policy, 4))
    model(random_ids(3), cache=cache)
    before = snapshot(cache)
    message = refused(lambda: model(random_ids(5, seed=2), cache=cache), "chunk of 5 tokens")
    assert "at most the cache size (4)" in message
    assert_untouched(cache, before)
    model(random_ids(4, seed=2), cache=cache)  # as wide as the cache: the documented chunked mode
    assert cache.seen == 7 and cache.slots == 4


@pytest.mark.parametrize("policy", UNIFORM_SCORED)
def test_a_one_entry_scored_cache_is_refused_up_front(policy):
    """The reported case: --cache-size 1 with the default chunk of 256."""
    cache = StreamingCache(tiny_model("llama"), build(policy, 1))
    assert cache.max_chunk == 1
    refused(lambda: cache.check_chunk_size(256), "chunk of 256 tokens over a cache of 1")
    cache.check_chunk_size(1)


def test_a_prompt_into_an_empty_cache_may_be_wider_than_the_cache():
    """model.generate prefills its prompt in one forward; the cut to the budget follows it."""
    model = tiny_model("llama")
    cache = StreamingCache(model, make_policy("h2o", 8))
    model(random_ids(20), cache=cache)
    assert cache.slots == 8 and cache.seen == 20


@pytest.mark.parametrize("policy", [*BANDED, "full"])
def test_band_and_unbounded_policies_take_any_chunk(policy):
    model = tiny_model("llama")
    cache = StreamingCache(model, make_policy(policy, None if policy == "full" else 4))
    assert cache.max_chunk is None
    cache.check_chunk_size(10_000)
    model(random_ids(3), cache=cache)
    model(random_ids(9, seed=2), cache=cache)
    assert cache.seen == 12


def test_feed_keeps_chunks_within_what_a_scored_cache_takes():
    model = tiny_model("llama", init_std=0.2)
    ids = random_ids(30)
    sizes = []
    logits = feed(
        model,
        StreamingCache(model, make_policy("h2o", 4)),
        ids,
        16,
        on_chunk=lambda piece, _: sizes.append(piece.shape[-1]),
    )
    assert sizes == [16, 4, 4, 4, 2]  # a wide first prompt chunk, then at most the cache
    cache = StreamingCache(model, make_policy("h2o", 4))
    for start, stop in [(0, 16), (16, 20), (20, 24), (24, 28), (28, 30)]:
        expected = model(ids[:, start:stop], cache=cache).logits[0, -1]
    assert torch.equal(logits, expected)


# -- padded batches ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 5], ids=["exact", "chunked"])
@pytest.mark.parametrize("policy", ALL)
def test_padded_batches_are_refused(policy, chunk):
    model = tiny_model("llama")
    cache = StreamingCache(model, build(policy, None if policy == "full" else 8))
    ids = torch.cat([random_ids(12, seed=s) for s in (1, 2)])
    model(ids[:, :6], cache=cache)
    before = snapshot(cache)
    mask = torch.ones(2, 6 + chunk, dtype=torch.long)
    mask[1, :3] = 0  # row 1 was left-padded
    refused(lambda: model(ids[:, 6 : 6 + chunk], attention_mask=mask, cache=cache), "padded batches are not supported")
    assert_untouched(cache, before)


def test_generate_with_a_left_padded_batch_is_refused():
    model = tiny_model("llama")
    ids = torch.cat([random_ids(10, seed=s) for s in (1, 2)])
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    refused(
        lambda: model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            do_sample=False,
            cache=StreamingCache(model, make_policy("h2o", 8)),
        ),
        "padded batches",
    )


@pytest.mark.parametrize("policy", EVICTING)
def test_a_mask_of_ones_changes_nothing_and_other_masks_are_refused(policy):
    model = tiny_model("llama", init_std=0.2)
    ids = torch.cat([random_ids(20, seed=s) for s in (1, 2)])
    plain, masked = StreamingCache(model, build(policy, 8)), StreamingCache(model, build(policy, 8))
    for start in range(0, 20, 5):
        expected = model(ids[:, start : start + 5], cache=plain).logits
        got = model(ids[:, start : start + 5], attention_mask=torch.ones(2, start + 5), cache=masked).logits
        assert torch.equal(got, expected)
    causal = torch.ones(2, 1, 5, 25, dtype=torch.bool)
    refused(lambda: model(ids[:, :5], attention_mask=causal, cache=masked), "builds the attention mask itself")


# -- API misuse --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "other",
    [dict(num_hidden_layers=3), dict(num_key_value_heads=1), dict(head_dim=8), dict(seed=1)],
    ids=["layers", "kv-heads", "head-dim", "same-shape"],
)
@pytest.mark.parametrize("attached", [False, True], ids=["plain", "attached"])
def test_a_cache_refuses_a_model_it_was_not_made_for(other, attached):
    model, stranger = tiny_model("llama"), tiny_model("llama", **other)
    if attached:  # the other model has caches of its own, so its forwards go through h2o-stream's hooks
        StreamingCache(stranger, make_policy("h2o", 8))
    for fed in (0, 5):
        cache = StreamingCache(model, make_policy("h2o", 8))
        if fed:
            model(random_ids(fed), cache=cache)
        before = snapshot(cache)
        refused(lambda cache=cache: stranger(random_ids(3), cache=cache), "made for|not made for")
        assert_untouched(cache, before)
        model(random_ids(3), cache=cache)  # still usable by its own model
        assert cache.seen == fed + 3


def test_a_refusal_names_both_models_shapes():
    model, stranger = tiny_model("llama"), tiny_model("llama", num_key_value_heads=1)
    StreamingCache(stranger, make_policy("h2o", 8))
    message = refused(lambda: stranger(random_ids(3), cache=StreamingCache(model, make_policy("h2o", 8))), "another")
    assert "2 layers, 2 KV heads of dimension 16" in message and "that one has 2 layers, 1 KV heads" in message


@pytest.mark.parametrize("new_tokens", [5, 30], ids=["tail-refed", "nothing-fed"])
def test_generate_twice_with_the_same_prompt_is_refused(new_tokens):
    model = tiny_model("llama")
    cache = StreamingCache(model, make_policy("h2o", 16))
    prompt = random_ids(20)
    first = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, cache=cache)
    before = snapshot(cache)
    refused(lambda: model.generate(prompt, max_new_tokens=5, do_sample=False, cache=cache), "model.generate")
    assert_untouched(cache, before)
    # continuing with the whole sequence so far is what generate supports, and still works
    longer = model.generate(first, max_new_tokens=5, do_sample=False, cache=cache)
    assert torch.equal(longer[:, : first.shape[1]], first) and cache.seen == longer.shape[1] - 1


def test_a_batch_size_change_is_refused_until_reset():
    model = tiny_model("llama")
    cache = StreamingCache(model, make_policy("sink", 8))
    model(torch.cat([random_ids(6, seed=s) for s in (1, 2)]), cache=cache)
    before = snapshot(cache)
    refused(lambda: model(random_ids(3), cache=cache), r"holds 2 stream\(s\) and the forward brings a batch of 1")
    assert_untouched(cache, before)
    cache.reset()
    model(random_ids(3), cache=cache)
    assert cache.seen == 3


# -- no rolling past the model's positions -----------------------------------------------------------------------------


def tiny_gpt2(positions: int):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=positions, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=1
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("model_kind", ["gpt2", "llama"])
def test_without_rolling_a_stream_past_the_context_is_refused_before_the_model_runs(model_kind):
    model = tiny_gpt2(16) if model_kind == "gpt2" else tiny_model("llama", max_position_embeddings=16)
    ids = random_ids(20)
    cache = StreamingCache(model, make_policy("h2o", 4), rolling=False)
    for t in range(16):  # exactly the context fits
        model(ids[:, t : t + 1], cache=cache)
    before = snapshot(cache)
    message = refused(lambda: model(ids[:, 16:17], cache=cache), "16 tokens fit in all and 0 more")
    assert "rolling" in message
    assert_untouched(cache, before)

    chunked = StreamingCache(model, make_policy("sink", 4), rolling=False)
    model(ids[:, :12], cache=chunked)
    refused(lambda: model(ids[:, 12:20], cache=chunked), "4 more fit in this cache")
    refused(lambda: StreamingCache(model, make_policy("sink", 4), rolling=False).check_fits(17), "not 17")


def test_with_rolling_the_same_model_streams_past_its_context():
    model = tiny_model("llama", max_position_embeddings=16)
    cache = StreamingCache(model, make_policy("h2o", 4))
    cache.check_fits(10_000)
    for start in range(0, 40, 4):
        model(random_ids(40)[:, start : start + 4], cache=cache)
    assert cache.seen == 40
