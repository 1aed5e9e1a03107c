"""Position rolling: no drift over long streams, the model's own rotary settings, clear refusals."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from h2o_stream import H2OStreamError, StreamingCache, make_policy
from h2o_stream.engine.cache import StreamingLayer
from h2o_stream.rope_rolling import RopeRoller
from support.tiny_models import tiny_model


def rotate_like_the_model(model, raw, position):
    """What the model's own code does to a key at `position` (partial rotary handled by the caller's dims)."""
    cos, sin = model.base_model.rotary_emb(raw, torch.tensor([[position]]))
    rot = cos.shape[-1]
    rotated = apply_rotary_pos_emb(raw[..., :rot], raw[..., :rot], cos, sin)[1]
    return torch.cat([rotated, raw[..., rot:]], dim=-1)


@pytest.mark.parametrize("family, steps", [("llama_yarn", 100_000), ("gpt_neox", 20_000)])
def test_keys_in_use_match_a_fresh_rotation_after_long_rolling(family, steps):
    model = tiny_model(family)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    heads = 2
    layer = StreamingLayer(make_policy("h2o", 16), RopeRoller.for_model(model))
    generator = torch.Generator().manual_seed(0)
    raw_keys = torch.randn(steps, heads, head_dim, generator=generator) * 3
    value = torch.zeros(1, heads, 1, 4)
    for t in range(steps):
        raw = raw_keys[t].view(1, heads, 1, head_dim)
        keys_in_use, _ = layer.update(rotate_like_the_model(model, raw, layer.slots), value)
        # random attention makes survivors (and so every key's slot) jump around, as H2O does
        layer.after_attention(torch.rand(1, heads, keys_in_use.shape[-2], generator=generator).double())
    assert layer.seen == steps and layer.slots == 16
    # the keys used in the last step (slots 0..16) against the raw keys rotated once, straight to their slot
    final_positions = layer.positions  # after the cut; recompute what the next step would use
    keys_next, _ = layer.update(rotate_like_the_model(model, raw_keys[0].view(1, heads, 1, head_dim), 16), value)
    for head in range(heads):
        for slot, position in enumerate(final_positions[0, head].tolist()):
            fresh = rotate_like_the_model(model, raw_keys[position, head].view(1, 1, 1, head_dim), slot)[0, 0, 0]
            used = keys_next[0, head, slot]
            assert (used - fresh).norm() <= 1e-5 * fresh.norm(), (position, slot)
    assert final_positions.min() < steps // 2  # some keys are old heavy hitters, renumbered many thousand times


def test_rolling_follows_attention_scaling_of_the_rope_type():
    model = tiny_model("llama_yarn")
    roller = RopeRoller.for_model(model)
    table = roller.table(8, torch.device("cpu"))
    scaling = model.model.rotary_emb.attention_scaling
    assert scaling != 1.0
    assert torch.allclose(table["ucos"] * scaling**2, table["cos"], rtol=1e-5)
    x = torch.randn(1, 2, 8, 16)
    assert torch.allclose(roller.unrotate(roller.rotate(x, 0, 8), 0, 8), x, atol=1e-6)


def test_unrotate_inverts_the_models_rotation_with_partial_rotary():
    model = tiny_model("phi3")
    roller = RopeRoller.for_model(model)
    raw = torch.randn(1, 2, 5, 16)
    rotated = torch.cat([rotate_like_the_model(model, raw[:, :, i : i + 1], 7 + i) for i in range(5)], dim=2)
    assert torch.allclose(roller.unrotate(rotated, 7, 12), raw, atol=1e-6)
    assert torch.equal(roller.unrotate(rotated, 7, 12)[..., 8:], raw[..., 8:])  # the pass-through half is untouched


def test_non_rope_model_is_refused_for_rolling():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(H2OStreamError, match="no-rolling"):
        StreamingCache(model, make_policy("sink", 8))


def test_budget_larger_than_the_model_context_is_refused():
    model = tiny_model("llama", max_position_embeddings=64)
    with pytest.raises(H2OStreamError, match="context of 64"):
        StreamingCache(model, make_policy("h2o", 64))
    StreamingCache(model, make_policy("h2o", 63))


def test_chunk_beyond_the_context_is_refused():
    model = tiny_model("llama", max_position_embeddings=64)
    cache = StreamingCache(model, make_policy("h2o", 48))
    with pytest.raises(H2OStreamError, match="smaller chunk"):
        model(torch.ones(1, 65, dtype=torch.long), cache=cache)
