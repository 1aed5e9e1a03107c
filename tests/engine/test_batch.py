"""A batch of independent streams through one StreamingCache equals each stream run alone (eviction is per row)."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import StreamingCache
from support.policy_matrix import EVICTING, build
from support.tiny_models import random_ids, tiny_model


def streamed_logits(model, policy, ids, chunk):
    cache = StreamingCache(model, build(policy, 12))  # 12: heavy hitters survive a chunk's first cut
    with torch.no_grad():
        logits = torch.cat([model(ids[:, i : i + chunk], cache=cache).logits for i in range(0, ids.shape[1], chunk)], 1)
    return logits, cache


@pytest.mark.parametrize("chunk", [1, 5], ids=["exact", "chunked"])
@pytest.mark.parametrize("policy", EVICTING)
def test_batched_streams_match_single_streams(policy, chunk):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = torch.cat([random_ids(60, seed=s) for s in (1, 2, 3)])
    batched, cache = streamed_logits(model, policy, ids, chunk)
    for row in range(ids.shape[0]):
        alone, _ = streamed_logits(model, policy, ids[row : row + 1], chunk)
        assert torch.allclose(batched[row], alone[0], atol=1e-4, rtol=0), (row, (batched[row] - alone[0]).abs().max())
    cache.settle()  # a fair chunk may leave its last cut to the next forward; read what the cache keeps
    kept = cache.layers[0].positions
    assert cache.evicted > 0
    if cache.policy.needs_scores and cache.policy.ranking.ranks_entries:  # rows saw different text, so heavy hitters
        assert any(not torch.equal(kept[0], kept[r]) for r in range(1, ids.shape[0]))  # must differ somewhere
