"""keyformer (Keyformer): its seeded Gumbel draws (the design's hash, Gumbel-distributed, the same in every path),
the temperature schedule, what the draws change and what they do not, and its bad settings. Its agreement with the
oracle is in test_policies_oracle.py."""

from __future__ import annotations

import math

import pytest
import torch

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine.draws import draw_bits, gumbel_noise, temperatures
from h2o_stream.errors import H2OStreamError
from support.oracle import Oracle, gumbel_draw, gumbel_hash
from support.ppl_helpers import ppl_error, write_corpus
from support.tiny_models import random_ids, tiny_model

BUDGET = 8


def test_the_draws_are_the_designs_hash_of_their_stream_indices():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 1 << 31, (1, 2, 40), generator=generator)
    queries = torch.cat([torch.tensor([0, 1, 7, (1 << 31) - 1]), torch.randint(0, 1 << 31, (20,), generator=generator)])
    bits = draw_bits(99, 3, 2, queries, keys).long() & 0xFFFFFFFF  # (1, kv_heads 2, group 2, 24, 40)
    noise = gumbel_noise(99, 3, 2, queries, keys, torch.float64)
    for kv in range(2):
        for g in range(2):
            for q, query in enumerate(queries.tolist()):
                for k, key in enumerate(keys[0, kv].tolist()):
                    assert bits[0, kv, g, q, k].item() == gumbel_hash(99, 3, kv * 2 + g, query, key)
                    expected = gumbel_draw(99, 3, kv * 2 + g, query, key)
                    assert noise[0, kv, g, q, k].item() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_the_draws_are_gumbel_distributed_and_differ_by_layer_head_and_seed():
    keys = torch.arange(2000).view(1, 1, -1)
    queries = torch.arange(100)
    noise = gumbel_noise(0, 0, 2, queries, keys, torch.float64)  # 400,000 draws
    assert noise.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler's constant
    assert noise.var().item() == pytest.approx(math.pi**2 / 6, rel=0.02)
    others = [
        noise[0, 0, 1],
        gumbel_noise(0, 1, 2, queries, keys, torch.float64)[0, 0, 0],
        gumbel_noise(1, 0, 2, queries, keys, torch.float64)[0, 0, 0],
    ]
    for other in others:  # another query head, another layer, another seed: uncorrelated draws
        assert abs(torch.corrcoef(torch.stack([noise[0, 0, 0].flatten(), other.flatten()]))[0, 1].item()) < 0.01


def test_the_temperature_rises_linearly_over_its_steps_then_holds():
    assert temperatures(1.0, 2.0, 4, torch.arange(7)).tolist() == [1.0, 1.25, 1.5, 1.75, 2.0, 2.0, 2.0]
    assert make_policy("keyformer", 256).tau_steps == 256  # 0: as many queries as the cache holds
    policy = make_policy("keyformer", 256)
    assert (policy.heavy, policy.recent) == (180, 76)  # the official code's recent window: 30% of the cache


def _kept(policy, ids, chunk=1):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    cache = StreamingCache(model, policy)
    for start in range(0, ids.shape[1], chunk):
        model(ids[:, start : start + chunk], cache=cache)
    cache.settle()
    return [layer.positions[0].tolist() for layer in cache.layers]


def test_a_run_repeats_with_its_seed_and_the_draws_change_what_is_kept():
    ids = random_ids(10 * BUDGET, seed=4)
    seeded = _kept(make_policy("keyformer", BUDGET, gumbel_seed=7), ids)
    assert seeded == _kept(make_policy("keyformer", BUDGET, gumbel_seed=7), ids)
    assert seeded != _kept(make_policy("keyformer", BUDGET, gumbel_seed=8), ids)
    split = make_policy("keyformer", BUDGET)
    assert _kept(split, ids) != _kept(make_policy("h2o", BUDGET, heavy=split.heavy), ids)


def test_the_oracle_comparison_can_fail_on_the_seed():
    """An engine drawing with another seed than the oracle's is caught."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    oracle = Oracle.for_policy(model, make_policy("keyformer", BUDGET, gumbel_seed=1))
    cache = StreamingCache(model, make_policy("keyformer", BUDGET, gumbel_seed=2))
    ids = random_ids(10 * BUDGET, seed=2)
    differs = False
    for t in range(ids.shape[1]):
        model(ids[:, t : t + 1], cache=cache)
        oracle.step(int(ids[0, t]))
        differs |= any(
            cache.layers[layer].positions[0, head].tolist() != oracle.kept_positions(layer, head)
            for layer in range(len(cache.layers))
            for head in range(2)
        )
    assert differs


def test_a_fair_chunk_draws_what_exact_mode_draws_for_the_same_query_and_key():
    """The draws of a layer's queries in a chunk are those the same queries get one at a time."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(12, seed=1)
    draws = []
    for chunk in (1, 4):
        cache = StreamingCache(model, make_policy("keyformer", 64))  # nothing is cut: every key stays
        for start in range(0, 12, chunk):
            model(ids[:, start : start + chunk], cache=cache)
        layer = cache.layers[1]
        noise, taus = layer.gumbel_draws(3, 2, torch.float64)  # the last 3 queries over the 12 keys
        draws.append((noise, taus))
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"tau_init": 0.0}, "tau_init (keyformer's first temperature) must be a number in (0, 1000000], got 0.0"),
        ({"tau_end": -1.0}, "tau_end (keyformer's last temperature) must be a number in (0, 1000000], got -1.0"),
        ({"tau_steps": -2}, "tau_steps (0: the cache size) must be a whole number"),
        ({"gumbel_seed": 1 << 32}, "gumbel_seed must be a whole number in (-1, 4294967295], got 4294967296"),
    ],
)
def test_a_bad_setting_is_one_clear_error(settings, message):
    with pytest.raises(H2OStreamError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        make_policy("keyformer", BUDGET, **settings)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--tau-init", 0, "--tau-init (keyformer's first temperature) must be a number in (0, 1000000], got 0.0"),
        ("--tau-steps", -1, "--tau-steps (0: the cache size) must be a whole number in (-1, 1099511627776], got -1"),
    ],
)
def test_a_bad_setting_on_the_command_line_is_one_error_line(ppl_model_dir, tmp_path, capsys, option, value, message):
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
        "keyformer",
        option,
        value,
    ]
    assert message in ppl_error(capsys, *args)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
