"""snapkv's (and pyramid's) two cuts of a fair chunk, compiled (engine/compiled_cuts.py), against the tensor
path: the same slots, with ties, both poolings and several kernels, and a chunked stream bit for bit. Its agreement
with the oracle is in test_policies_oracle.py."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import StreamingCache, make_policy
from support.tiny_models import random_ids, tiny_model


def _both_ways(first, then, positions, scores, monkeypatch):
    compiled = first.keep_twice(then, positions, scores)
    with monkeypatch.context() as patch:
        patch.setenv("H2O_STREAM_COMPILED", "0")
        on_tensors = first.keep_twice(then, positions, scores)
    return compiled, on_tensors


@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
@pytest.mark.parametrize("max_pool", [False, True], ids=["average", "maximum"])
@pytest.mark.parametrize("chunk", [2, 4, 9, 30])
def test_the_compiled_cuts_keep_the_slots_the_tensor_path_keeps(kernel, max_pool, chunk, monkeypatch):
    generator = torch.Generator().manual_seed(kernel * 10 + chunk)
    policy = make_policy("snapkv", 40, recent=6, kernel=kernel, max_pool=max_pool)
    then = policy.reduced(41 - chunk)
    n = 41  # a pending cut (budget + 1 held) and the chunk's own
    positions = torch.arange(n).expand(2, 3, n).contiguous()
    # few distinct values (many ties) in one batch row, spread values in the other
    scores = torch.randint(0, 3, (2, 3, n, policy.observation), generator=generator).double() / 8
    scores[1] = torch.rand(3, n, policy.observation, generator=generator, dtype=torch.float64)
    compiled, on_tensors = _both_ways(policy, then, positions, scores, monkeypatch)
    assert compiled.shape == (2, 3, then.budget) and compiled.dtype == torch.long
    assert torch.equal(compiled, on_tensors)


@pytest.mark.parametrize("name", ["snapkv", "pyramid"])
def test_a_chunked_stream_is_the_same_bit_for_bit_compiled_or_not(name, monkeypatch):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(120, seed=4)

    def stream():
        cache = StreamingCache(model, make_policy(name, 16, recent=4))
        logits = torch.cat([model(ids[:, i : i + 4], cache=cache).logits for i in range(0, 120, 4)], dim=1)
        cache.settle()
        return logits, [layer.positions for layer in cache.layers], cache.evicted

    compiled = stream()
    monkeypatch.setenv("H2O_STREAM_COMPILED", "0")
    on_tensors = stream()
    assert compiled[2] > 0 and compiled[2] == on_tensors[2]
    assert torch.equal(compiled[0], on_tensors[0])
    assert all(torch.equal(a, b) for a, b in zip(compiled[1], on_tensors[1], strict=True))
