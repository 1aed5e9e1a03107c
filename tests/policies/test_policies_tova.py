"""`tova` against a re-statement of the official TOVA cache (schwartz-lab-NLP/TOVA, src/tova_cache.py): keys at their
true positions, the mean over every query head of the last query's attention, `torch.topk` of it kept, entries
reordered by that top-k as the official cache does. Exact mode with rolling off must equal it token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface

from h2o_stream import StreamingCache, make_policy
from support.tiny_models import random_ids, tiny_model

_NAME = "h2o_stream_test_tova_reference"


class OfficialTOVA:
    """Per layer: keys/values (rotated by the model at their stream positions) and their stream positions, cut to
    `cache_size` by the top-k of the head-averaged attention of the current query, in top-k order."""

    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.layers: dict[int, list[torch.Tensor]] = {}

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        position = kwargs["position"]
        stored = self.layers.get(module.layer_idx)
        if stored is None:
            keys, values, positions = key, value, torch.tensor([position])
        else:
            keys = torch.cat([stored[0], key], dim=2)
            values = torch.cat([stored[1], value], dim=2)
            positions = torch.cat([stored[2], torch.tensor([position])])
        group = query.shape[1] // keys.shape[1]
        full_keys, full_values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        weights = torch.softmax(query @ full_keys.transpose(-1, -2) * scaling, dim=-1, dtype=torch.float32)
        output = (weights.to(values.dtype) @ full_values).transpose(1, 2)
        if keys.shape[2] > self.cache_size:
            mean = weights[:, :, -1, :].mean(dim=1)
            index = torch.topk(mean, k=self.cache_size, dim=-1).indices[0]
            keys, values, positions = keys[:, :, index], values[:, :, index], positions[index]
        self.layers[module.layer_idx] = [keys, values, positions]
        return output, None


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_tova_without_rolling_equals_the_official_cache_token_for_token(kv_heads):
    budget = 8
    model = tiny_model("llama", num_key_value_heads=kv_heads, init_std=0.2)
    ids = random_ids(10 * budget, seed=kv_heads)
    reference = OfficialTOVA(budget)
    AttentionInterface.register(_NAME, reference.attention)
    expected, kept = [], []
    previous = model.config._attn_implementation
    model.set_attn_implementation(_NAME)
    try:
        for t in range(ids.shape[1]):
            position = torch.tensor([[t]])
            expected.append(model(ids[:, t : t + 1], position_ids=position, use_cache=False, position=t).logits[0, -1])
            kept.append([sorted(reference.layers[i][2].tolist()) for i in sorted(reference.layers)])
    finally:
        model.set_attn_implementation(previous)
    cache = StreamingCache(model, make_policy("tova", budget), rolling=False)
    for t in range(ids.shape[1]):
        logits = model(ids[:, t : t + 1], cache=cache).logits[0, -1]
        assert torch.allclose(logits, expected[t], atol=1e-4, rtol=0), (t, (logits - expected[t]).abs().max())
        for layer_idx, layer in enumerate(cache.layers):
            for head in range(kv_heads):
                assert layer.positions[0, head].tolist() == kept[t][layer_idx], (t, layer_idx, head)
    assert cache.evicted > 0
