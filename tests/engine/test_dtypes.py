"""Half-precision models: every policy streams in bfloat16 and float16, exact and chunked, with float64 scores
(counts, whole numbers, in float32)."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import StreamingCache
from support.policy_matrix import ALL, EVICTING, build
from support.tiny_models import random_ids, tiny_model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("chunk", [1, 4], ids=["exact", "chunked"])
def test_every_policy_streams_a_half_precision_model_with_scores_in_float64(dtype, policy, chunk):
    reference = tiny_model("llama", init_std=0.2)
    model = tiny_model("llama", init_std=0.2).to(dtype)
    ids = random_ids(96)
    logits = {}
    for name, m in (("float32", reference), ("half", model)):
        cache = StreamingCache(m, build(policy, 16))
        logits[name] = torch.cat([m(ids[:, s : s + chunk], cache=cache).logits[0].float() for s in range(0, 96, chunk)])
        layer = cache.layers[0]
        assert layer.keys.dtype == m.dtype
        if cache.policy.needs_scores:
            # ranking never in half precision; counts above a quantile (whole numbers) are exact in float32
            assert layer.scores.dtype == (torch.float32 if cache.policy.score_quantile else torch.float64)
        else:
            assert layer.scores is None and layer.state()["scores"].dtype == torch.float64  # the snapshot has zeros
        if policy in EVICTING:
            assert cache.slots == 16 and cache.evicted > 0
    assert not torch.isnan(logits["half"]).any()
    # before the first eviction both runs hold the same entries: half precision changes the logits only by rounding
    tolerance = 0.1 if dtype is torch.float16 else 0.5
    assert (logits["half"][:16] - logits["float32"][:16]).abs().max() < tolerance
