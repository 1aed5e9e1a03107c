"""The fused paths (the sink path's flash kernel + log-sum-exp merge; a latest-query policy's fused attention and one
row of probabilities) against the explicit-softmax reference."""

from __future__ import annotations

import pytest
import torch

from h2o_stream.engine.attention import (
    Extras,
    attend,
    attend_scoring_last_query,
    attend_with_sink_queries,
    band_bias,
    fused_sink_attention_applies,
)
from h2o_stream.engine.policies.scoring import LATEST


@pytest.mark.parametrize("batch,q_heads,kv_heads", [(1, 9, 3), (2, 4, 4), (1, 4, 1)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # the model hands over transposed projections
def test_fused_sink_attention_equals_explicit_softmax(batch, q_heads, kv_heads, layout):
    torch.manual_seed(0)
    sinks, cached, length, dim = 4, 24, 16, 32

    def queries():
        if layout == "contiguous":
            return torch.randn(batch, q_heads, length, dim)
        return torch.randn(batch, length, q_heads, dim).transpose(1, 2)

    query, sink_query = queries(), queries()
    key = torch.randn(batch, kv_heads, cached + length, dim) * 2
    value = torch.randn(batch, kv_heads, cached + length, dim)
    query_slot = torch.arange(cached, cached + length).unsqueeze(-1)
    key_slot = torch.arange(cached + length)
    # two masks of one shape in turn: the memoised additive band must follow the mask, not its shape
    for recent in (20, 6, 20):
        mask = ((key_slot <= query_slot) & ((key_slot < sinks) | (key_slot >= query_slot - recent)))[None, None]
        assert fused_sink_attention_applies(query, key, mask, sinks)
        fused = attend_with_sink_queries(query, key, value, mask, 0.2, sink_query, sinks)
        reference = attend(query, key, value, mask, 0.2, Extras(sink_query=sink_query, sink_columns=sinks))[0]
        assert fused.shape == reference.shape == (batch, length, q_heads, dim)
        assert torch.allclose(fused, reference, atol=1e-5, rtol=0), (recent, (fused - reference).abs().max())


@pytest.mark.parametrize("batch,q_heads,kv_heads", [(1, 9, 3), (2, 4, 4), (1, 4, 1)])
@pytest.mark.parametrize("mask_form", ["bool", "additive", "none"])
def test_latest_query_scores_with_fused_attention_equal_explicit_softmax(batch, q_heads, kv_heads, mask_form):
    torch.manual_seed(1)
    cached, length, dim = 40, 16 if mask_form != "none" else 1, 32
    query = torch.randn(batch, length, q_heads, dim).transpose(1, 2)
    key, value = (
        torch.randn(batch, kv_heads, cached + length, dim) * 2,
        torch.randn(batch, kv_heads, cached + length, dim),
    )
    visible = (torch.arange(cached + length) <= torch.arange(cached, cached + length).unsqueeze(-1))[None, None]
    visible = visible & (torch.arange(cached + length) != 3)  # a key hidden from every query, the last included
    mask = {"bool": visible, "none": None}.get(mask_form)
    if mask_form == "additive":
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    output, received = attend_scoring_last_query(query, key, value, mask, 0.2)
    reference, probs, _ = attend(query, key, value, mask, 0.2)
    expected = LATEST.gathered(None, probs, mask)
    assert output.shape == reference.shape and received.shape == expected.shape == (batch, kv_heads, cached + length)
    assert torch.allclose(output, reference, atol=1e-5, rtol=0), (output - reference).abs().max()
    assert torch.allclose(received, expected, atol=1e-6, rtol=0), (received - expected).abs().max()
    if mask is not None:
        assert (received[..., 3] == 0).all()  # what the last query does not see receives nothing
    assert torch.allclose(received.sum(-1), torch.full((batch, kv_heads), float(q_heads // kv_heads)))


def test_fused_sink_attention_refuses_chunks_that_start_among_the_sinks():
    query, key = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 10, 16)
    mask = torch.ones(1, 1, 8, 10, dtype=torch.bool)
    assert not fused_sink_attention_applies(query, key, mask, 4)  # only 2 entries were cached before the chunk
    assert fused_sink_attention_applies(query, key, mask, 2)


def test_band_bias_is_memoised_per_mask_but_not_kept_for_very_wide_chunks():
    small = torch.ones(1, 1, 16, 40, dtype=torch.bool)
    assert band_bias(small, 4, 3, torch.float32) is band_bias(small, 4, 3, torch.float32)
    wide = torch.ones(1, 1, 2048, 4096, dtype=torch.bool)  # a 2048-token chunk: 96 MB in additive form with group 3
    first, second = band_bias(wide, 4, 3, torch.float32), band_bias(wide, 4, 3, torch.float32)
    assert first is not second and torch.equal(first, second)
    assert first.shape == (1, 1, 3 * 2048, 4096) and torch.isinf(first[..., :4]).all() and (first[..., 4:] == 0).all()
