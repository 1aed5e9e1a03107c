"""cam (CaM): what a cut merges (hand-computed), how often a coin says merge, that it keeps what sink keeps but
attends differently, that an oracle that drops instead of merging is caught, and its bad settings. Its agreement
with the oracle is in test_policies_oracle.py and test_engine.py."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine.draws import entry_uniforms, entry_uniforms_on_tensors
from h2o_stream.engine.policies.merging import merge_evicted
from h2o_stream.errors import H2OStreamError
from support.oracle import Oracle, Rules, entry_uniform
from support.ppl_helpers import ppl_error, write_corpus
from support.tiny_models import random_ids, tiny_model

BUDGET = 8


def test_an_entry_attended_above_the_mean_after_it_is_spread_over_the_span_after_it():
    positions = torch.arange(6).view(1, 1, 6)
    values = torch.arange(12, dtype=torch.float64).view(1, 1, 6, 2)
    kept = torch.tensor([[[True, False, True, True, True, True]]])
    # slot 1 received 0.4, the four after it 0.1 each on average: a / m = 4, a sure merge
    scores = torch.tensor([[[0.2, 0.4, 0.1, 0.1, 0.1, 0.1]]], dtype=torch.float64)
    merged = merge_evicted(values, positions, scores, kept, span=2, seed=0, layer=0)
    expected = values.clone()
    expected[0, 0, 2:4] += values[0, 0, 1] / 2  # the two entries after it; nothing else changes
    assert torch.equal(merged, expected)
    unattended = torch.tensor([[[0.2, 0.0, 0.1, 0.1, 0.1, 0.1]]], dtype=torch.float64)
    assert torch.equal(merge_evicted(values, positions, unattended, kept, span=2, seed=0, layer=0), values)


def _one_after_another(values, positions, scores, kept, span, seed, layer):
    """The merge as docs/design.md says it: each evicted entry in turn, oldest first, with its value as it is then."""
    n = positions.shape[-1]
    slot = torch.arange(n)
    attention = scores.double()
    after = attention.flip(-1).cumsum(-1).flip(-1) - attention
    chance = torch.nan_to_num(attention / (after / (n - 1 - slot).clamp(min=1)), nan=0.0, posinf=1.0).clamp(max=1)
    merges = entry_uniforms(seed, layer, positions) < chance
    values = values.clone()
    for b, h in itertools.product(range(positions.shape[0]), range(positions.shape[1])):
        for e in range(n):
            if not kept[b, h, e] and merges[b, h, e]:
                values[b, h, e + 1 : e + 1 + span] += values[b, h, e] / span
    return values


@pytest.mark.parametrize("trial", range(6))
def test_merging_at_once_is_merging_one_after_another(trial):
    generator = torch.Generator().manual_seed(trial)
    positions = torch.arange(40).view(1, 1, 40).expand(2, 3, 40).contiguous()
    values = torch.randn(2, 3, 40, 5, generator=generator, dtype=torch.float64)
    scores = torch.rand(2, 3, 40, generator=generator, dtype=torch.float64)
    kept = torch.ones(2, 3, 40, dtype=torch.bool)
    kept[..., 2 : 4 + 3 * trial] = False  # up to 17 evicted, within each other's span
    merged = merge_evicted(values, positions, scores, kept, span=3 + trial, seed=trial, layer=1)
    expected = _one_after_another(values, positions, scores, kept, 3 + trial, trial, 1)
    assert not torch.equal(expected, values)
    assert torch.allclose(merged, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_merges_are_the_linear_solves_to_float_rounding(dtype, monkeypatch):
    """The compiled merges (one after another) against the tensor path's triangular solve, evicted entries in each
    other's span and heads evicting different slots; both compare with merging by hand."""
    generator = torch.Generator().manual_seed(5)
    positions = torch.arange(60).view(1, 1, 60).expand(2, 3, 60).contiguous()
    values = torch.randn(2, 3, 60, 8, generator=generator, dtype=dtype)
    scores = torch.rand(2, 3, 60, generator=generator, dtype=torch.float64)
    # each head evicts 20 slots (a cut keeps the budget in every head): a run within each other's span, the rest apart
    kept = torch.ones(2, 3, 60, dtype=torch.bool)
    kept[..., 7:19] = False
    for b, h in itertools.product(range(2), range(3)):
        kept[b, h, 20 + torch.randperm(40, generator=generator)[:8]] = False
    compiled = merge_evicted(values, positions, scores, kept, span=5, seed=2, layer=3)
    monkeypatch.setenv("H2O_STREAM_COMPILED", "0")
    solved = merge_evicted(values, positions, scores, kept, span=5, seed=2, layer=3)
    by_hand = _one_after_another(values.double(), positions, scores, kept, 5, 2, 3)
    assert compiled.dtype == solved.dtype == dtype and not torch.equal(solved, values)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(compiled.double(), by_hand, atol=tolerance, rtol=0)
    assert torch.allclose(compiled, solved, atol=tolerance, rtol=0)


def test_a_merge_happens_with_the_attention_ratio_as_its_chance():
    """An entry at half the mean attention after it merges half the time, by its seeded coin."""
    n = 4001
    positions = torch.arange(n).view(1, 1, n)
    values = torch.zeros(1, 1, n, 1, dtype=torch.float64)
    values[0, 0, 0, 0] = 1.0
    scores = torch.ones(1, 1, n, dtype=torch.float64)
    scores[0, 0, 0] = 0.5
    kept = torch.ones(1, 1, n, dtype=torch.bool)
    kept[0, 0, 0] = False
    merges = 0
    for seed in range(400):
        merged = merge_evicted(values, positions, scores, kept, span=1, seed=seed, layer=0)
        merges += int(merged[0, 0, 1, 0] == 1.0)
        assert (merged[0, 0, 1, 0] == 1.0) == (entry_uniform(seed, 0, 0, 0) < 0.5)  # the oracle's coin
    assert 160 <= merges <= 240


@pytest.mark.parametrize("draw", [entry_uniforms, entry_uniforms_on_tensors])  # compiled on CPU; any device
def test_the_coins_are_the_designs_hash_of_layer_head_and_position(draw):
    positions = torch.randint(0, 1 << 33, (2, 3, 7), generator=torch.Generator().manual_seed(1))
    positions = positions.transpose(0, 1).contiguous().transpose(0, 1)  # as a cut may hand them: not contiguous
    coins = draw(11, 4, positions)
    assert coins.dtype == torch.float64 and coins.shape == positions.shape
    assert all(
        coins[b, h, i].item() == entry_uniform(11, 4, h, positions[b, h, i].item())
        for b in range(2)
        for h in range(3)
        for i in range(7)
    )


def _stream(policy, ids, chunk=1):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    cache = StreamingCache(model, policy)
    logits = torch.cat([model(ids[:, s : s + chunk], cache=cache).logits[0] for s in range(0, ids.shape[1], chunk)])
    cache.settle()
    return logits, [layer.positions.tolist() for layer in cache.layers], cache


@pytest.mark.parametrize("chunk", [1, 4], ids=["exact", "fair-chunks"])
def test_cam_keeps_what_sink_keeps_and_its_merged_values_change_the_stream(chunk):
    ids = random_ids(10 * BUDGET, seed=3)
    cam_logits, cam_kept, cache = _stream(make_policy("cam", BUDGET, merge_span=3), ids, chunk)
    sink_logits, sink_kept, _ = _stream(make_policy("sink", BUDGET), ids, chunk)
    assert cam_kept == sink_kept
    assert not torch.allclose(cam_logits, sink_logits, atol=1e-3)
    assert cache.evicted > 0


def test_an_oracle_that_drops_instead_of_merging_is_caught():
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    spec = make_policy("cam", BUDGET, merge_span=3)
    oracle = Oracle(model, dataclasses.replace(Rules.of(spec), merge=None))
    cache = StreamingCache(model, spec)
    ids = random_ids(10 * BUDGET, seed=2)
    worst = 0.0
    for t in range(ids.shape[1]):
        engine = model(ids[:, t : t + 1], cache=cache).logits[0, -1]
        worst = max(worst, (engine - oracle.step(int(ids[0, t]))).abs().max().item())
    assert worst > 1e-3


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"merge_span": 0}, "merge_span (cam's merge span) must be a whole number in (0, 1048576], got 0"),
        ({"merge_seed": -1}, "merge_seed must be a whole number in (-1, 4294967295], got -1"),
    ],
)
def test_a_bad_setting_is_one_clear_error(settings, message):
    with pytest.raises(H2OStreamError) as error:
        make_policy("cam", BUDGET, **settings)
    assert message in str(error.value)


def test_a_bad_merge_span_on_the_command_line_is_one_error_line(ppl_model_dir, tmp_path, capsys):
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        write_corpus(tmp_path / "corpus.jsonl"),
        "--tokens",
        60,
        "--cache-size",
        16,
        "--out",
        tmp_path / "out",
        "--policy",
        "cam",
        "--merge-span",
        0,
    ]
    assert "--merge-span (cam's merge span) must be a whole number" in ppl_error(capsys, *args)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
