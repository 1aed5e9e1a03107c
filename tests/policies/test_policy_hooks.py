"""The hooks the policy zoo plugs into: how attention becomes a score (every query or the last, each KV head or the
layer's mean), ages, and keys and token ids for the cut (sepllm's separators from a tokenizer), on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

from h2o_stream import H2OStreamError, StreamingCache, make_policy
from h2o_stream.engine.attention import attend, layer_mean
from h2o_stream.engine.policies.scoring import LATEST, SUM
from h2o_stream.engine.policies.sepllm import SEPARATOR_PUNCTUATION, SepLLMPolicy, separator_ids
from h2o_stream.engine.policies.slots import ages
from support.tiny_models import random_ids, tiny_model

#: what conftest's `tokenizer` is trained on here: every separator mark, and words without any
TRAINING_TEXTS = [
    "Hello, world. What is two plus two? Four! Then: more; text.\nA new line,\tand a tab.",
    "plain words without any marks at all",
    "one. two, three? four! five; six: seven",
]


def test_ages_count_steps_in_the_cache():
    assert ages(torch.tensor([[[0, 1, 5, 9]]])).tolist() == [[[10, 9, 5, 1]]]


def test_the_last_query_option_scores_only_the_last_query_and_layer_mean_averages_every_query_head():
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    mask = (torch.arange(7) <= torch.arange(4, 7).unsqueeze(-1))[None, None]
    _, given, _ = attend(query, key, value, mask, 0.3)
    every, last = SUM.gathered(None, given, mask), LATEST.gathered(None, given, mask)
    probs = torch.softmax(
        (query.view(1, 2, 2, 3, 8) * 0.3) @ key.unsqueeze(2).transpose(-1, -2)
        + torch.where(mask, 0.0, -math.inf).unsqueeze(2),
        dim=-1,
    )
    assert torch.allclose(every, probs.sum(dim=(2, 3)), atol=1e-6)
    assert torch.allclose(last, probs[..., -1, :].sum(dim=2), atol=1e-6)
    mean = layer_mean(last, 4)
    assert torch.allclose(mean[0, 0], probs[..., -1, :].sum(dim=(1, 2))[0] / 4) and torch.equal(mean[0, 0], mean[0, 1])


def test_a2sf_without_forgetting_and_h2o_sinks_without_sinks_are_h2o():
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(90)
    runs = {}
    for name, spec in [
        ("h2o", make_policy("h2o", 12)),
        ("a2sf", make_policy("a2sf", 12, alpha=1)),
        ("h2o_sinks", make_policy("h2o_sinks", 12, sinks=0)),
    ]:
        cache = StreamingCache(model, spec)
        logits = torch.cat([model(ids[:, i : i + 4], cache=cache).logits for i in range(0, 90, 4)], dim=1)
        runs[name] = logits, [layer.positions for layer in cache.layers]
    for name in ("a2sf", "h2o_sinks"):
        assert torch.equal(runs[name][0], runs["h2o"][0])
        assert all(torch.equal(a, b) for a, b in zip(runs[name][1], runs["h2o"][1], strict=True))


def test_tova_in_a_chunk_keeps_what_the_last_query_attends_to_most():
    """The official code's prompt handling: one cut, by the last query's attention averaged over the layer's heads."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(20)
    cache = StreamingCache(model, make_policy("tova", 6))
    captured = []
    original = cache.layers[0].after_attention
    cache.layers[0].after_attention = lambda received, **kwargs: (
        captured.append(received.clone()),
        original(received, **kwargs),
    )
    model(ids, cache=cache)
    kept = cache.layers[0].positions[0, 0]
    expected = torch.sort(torch.sort(captured[0][0, 0], descending=True, stable=True).indices[:6]).values
    assert kept.tolist() == expected.tolist() and torch.equal(captured[0][0, 0], captured[0][0, 1])
    assert captured[0][0, 0].sum().item() == pytest.approx(1.0)  # one query's distribution, not twenty


# -- keys and token ids for `keep` ----------------------------------------------------------------------------------


def test_separators_come_from_the_tokenizer(tokenizer):
    ids = separator_ids(tokenizer)
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    assert ids and all(all(c in SEPARATOR_PUNCTUATION or c.isspace() for c in texts[i]) for i in ids)
    for mark in [",", ".", "?", "!", ";", ":", "\n"]:  # each mark's own token is among them
        assert tokenizer.convert_tokens_to_ids(tokenizer.tokenize(mark))[0] in ids, mark
    assert not set(ids) & set(tokenizer.all_special_ids)
    words = tokenizer("plain words")["input_ids"]
    assert not set(words) & set(ids)
    policy = make_policy("sepllm", 20, tokenizer=tokenizer)
    assert (policy.sinks, policy.separators, policy.recent, policy.separator_ids) == (4, 4, 12, ids)
    assert policy.describe() == f"sepllm(sinks=4, separators=4, recent=12; {len(ids)} separator tokens)"
    assert policy.settings()["separator_ids"] == list(ids)


def test_sepllm_keeps_the_last_separators_of_real_text(tokenizer, model):
    text = "Hello, world. What is two plus two? Four! Then: more; text. " * 6
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    policy = make_policy("sepllm", 16, tokenizer=tokenizer, sinks=2, separators=6)
    cache = StreamingCache(model, policy)
    for t in range(ids.shape[1]):
        model(ids[:, t : t + 1], cache=cache)
    stream = ids[0].tolist()
    kept = cache.layers[1].positions[0, 0].tolist()
    middle_candidates = [p for p in range(2, len(stream) - 8) if stream[p] in policy.separator_ids]
    assert kept[:2] == [0, 1] and kept[-8:] == list(range(len(stream) - 8, len(stream)))
    assert kept[2:8] == middle_candidates[-6:]


def test_sepllm_refuses_embeddings_and_empty_separator_lists():
    model = tiny_model("llama")
    policy = SepLLMPolicy(sinks=1, separators=2, recent=3, separator_ids=(5, 9))
    cache = StreamingCache(model, policy)
    with pytest.raises(H2OStreamError, match="reads the token id of every entry"):
        model(inputs_embeds=model.get_input_embeddings()(random_ids(3)), cache=cache)
    assert cache.seen == 0
    with pytest.raises(H2OStreamError, match="no separator tokens"):
        SepLLMPolicy(sinks=1, separators=2, recent=3, separator_ids=())


@pytest.mark.parametrize("chunk", [1, 5], ids=["exact", "chunked"])
def test_sepllm_batches_rows_independently_and_saves_its_token_ids(chunk):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    # separators to spare: a fair chunk of 5 first cuts this budget of 16 to 12, keeping 6 of them
    policy = SepLLMPolicy(sinks=2, separators=9, recent=5, separator_ids=tuple(range(2, 101, 3)))
    ids = torch.cat([random_ids(60, seed=s) for s in (1, 2)])

    def run(rows, cache=None):
        cache = cache or StreamingCache(model, policy)
        return torch.cat([model(rows[:, i : i + chunk], cache=cache).logits for i in range(0, 60, chunk)], 1), cache

    batched, cache = run(ids)
    for row in range(2):
        assert torch.allclose(batched[row], run(ids[row : row + 1])[0][0], atol=1e-4, rtol=0)
    assert not torch.equal(cache.layers[0].positions[0], cache.layers[0].positions[1])
    # a saved cache carries the token ids and continues exactly
    restored = StreamingCache(model, policy)
    restored.load_state(cache.state())
    more = random_ids(5, seed=5).expand(2, 5)
    assert torch.equal(model(more, cache=restored).logits, model(more, cache=cache).logits)
    assert torch.equal(restored.layers[0].tokens, cache.layers[0].tokens)


@pytest.mark.parametrize("name", ["keydiff", "sepllm"])
def test_policies_without_scores_keep_the_fused_path_and_refuse_chunks_wider_than_the_cache(name, monkeypatch):
    import h2o_stream.engine.hooks as hooks

    model = tiny_model("llama")
    policy = (
        make_policy("keydiff", 4)
        if name == "keydiff"
        else SepLLMPolicy(sinks=1, separators=1, recent=2, separator_ids=(3,))
    )
    cache = StreamingCache(model, policy)
    calls = []
    monkeypatch.setattr(hooks, "attend", lambda *a, **k: calls.append(1))
    model(random_ids(3), cache=cache)
    assert not calls  # plain SDPA: no explicit softmax for a policy that needs no scores
    assert cache.max_chunk == 4
    with pytest.raises(H2OStreamError, match="chunk of 5 tokens"):
        model(random_ids(5, seed=2), cache=cache)


def test_generate_with_sepllm_matches_a_manual_greedy_loop():
    model = tiny_model("llama", init_std=0.2)
    policy = SepLLMPolicy(sinks=2, separators=4, recent=10, separator_ids=tuple(range(2, 101, 3)))
    prompt = random_ids(20)
    got = model.generate(prompt, max_new_tokens=30, do_sample=False, cache=StreamingCache(model, policy))
    cache = StreamingCache(model, policy)
    tokens, logits = prompt, model(prompt, cache=cache).logits[:, -1]
    for _ in range(30):
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=-1)
        logits = model(tokens[:, -1:], cache=cache).logits[:, -1]
    assert torch.equal(got, tokens) and cache.slots == 16


def test_each_scoring_makes_its_update_from_the_attention_probabilities():
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(1, 2, 3, 5, 9), dim=-1)  # (batch, kv_heads, group, q_len, k_len)
    per_query = probs.sum(dim=2).double()  # (batch, kv_heads, q_len, k_len)
    a2sf = make_policy("a2sf", 12, alpha=0.5)
    decayed = a2sf.scoring.rule.received(a2sf, probs, None)
    weights = 0.5 ** torch.arange(4, -1, -1, dtype=torch.float64)
    assert torch.allclose(decayed.double(), (per_query * weights[:, None]).sum(2), atol=1e-6)
    assert torch.equal(a2sf.scoring.rule.received(a2sf, probs[..., -1:, :], None), probs[..., -1, :].sum(2))
    roco = make_policy("roco", 24)
    moments = roco.scoring.rule.received(roco, probs, None)
    assert moments.shape == (1, 2, 9, 2) and moments.dtype == torch.float64
    assert torch.allclose(moments, torch.stack([per_query.sum(2), per_query.square().sum(2)], -1))
    snapkv = make_policy("snapkv", 24, observation=3)
    window = snapkv.scoring.rule.received(snapkv, probs, None)
    assert torch.allclose(window, per_query[:, :, -3:].transpose(-1, -2))  # the last 3 queries, oldest first
    tova = make_policy("tova", 12)  # the layer's mean of the last query
    latest = tova.scoring.rule.received(tova, probs, None)
    assert torch.allclose(latest, (probs[..., -1, :].sum(dim=(1, 2)) / 6).expand(1, 2, 9))
