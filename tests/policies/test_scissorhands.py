"""scissorhands: counts of the latest queries whose heads gave an entry more than a quantile of their row (the
threshold as the official code takes it), against a plain count, in exact mode and in masked chunk rows; its
settings refused on the command line with one error each."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine.attention import above_quantile, window_counts
from support.ppl_helpers import ppl_error, write_corpus
from support.tiny_models import random_ids, tiny_model


def plain_above(row: list[float], quantile: float) -> list[float]:
    """1 where a value beats the one at ascending index floor(quantile * n) (at most n - 1) of the n given."""
    threshold = sorted(row)[min(math.floor(quantile * len(row)), len(row) - 1)]
    return [float(p > threshold) for p in row]


@pytest.mark.parametrize("quantile", [0.9, 0.5, 0.99, 1.0])
def test_above_quantile_counts_what_beats_each_rows_quantile_among_the_keys_it_sees(quantile):
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(1, 2, 3, 4, 12, generator=generator, dtype=torch.float64)  # (batch, kv, group, q_len, k_len)
    mask = torch.zeros(1, 1, 4, 12, dtype=torch.float64)
    for q in range(4):  # a chunk's causal tail: query q sees the first 9 + q keys
        mask[0, 0, q, 9 + q :] = float("-inf")
        probs[..., q, 9 + q :] = 0.0
    counted = above_quantile(probs, mask, quantile)
    for kv in range(2):
        for g in range(3):
            for q in range(4):
                seen = probs[0, kv, g, q, : 9 + q].tolist()
                assert counted[0, kv, g, q, : 9 + q].tolist() == plain_above(seen, quantile)
                assert not counted[0, kv, g, q, 9 + q :].any()
    everything = above_quantile(probs[..., -1:, :], None, quantile)  # no mask: every key seen
    assert everything[0, 1, 2, 0].tolist() == plain_above(probs[0, 1, 2, 3].tolist(), quantile)


@pytest.mark.parametrize("quantile", [0.9, 0.5, 0.7, 1.0])
def test_the_compiled_count_equals_the_tensor_path(quantile, monkeypatch):
    """engine/compiled_counts.py against above_quantile summed over the group: rows of two batch rows with their
    own masks, probabilities with ties (a coarse grid) and zeros, float32 and float64."""
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        probs = (torch.randint(0, 6, (2, 3, 4, 5, 40), generator=generator) / 8).to(dtype)
        mask = torch.zeros(2, 1, 5, 40, dtype=dtype)
        for b, first in ((0, 30), (1, 33)):  # each row of the batch sees its own number of keys
            for q in range(5):
                mask[b, 0, q, first + q :] = float("-inf")
                probs[b, ..., q, first + q :] = 0.0
        counts = {}
        for compiled in ("0", "1"):
            monkeypatch.setenv("H2O_STREAM_COMPILED", compiled)
            counts[compiled] = window_counts(probs, mask, quantile)
        assert counts["1"].shape == (2, 3, 40, 5) and counts["1"].dtype == counts["0"].dtype == torch.float32
        assert (counts["1"].sum() > 0) == (quantile < 1)  # nothing beats a row's largest value
        assert torch.equal(counts["1"], counts["0"])


def test_the_compiled_selection_finds_every_rank_of_rows_with_ties():
    """Non-negative floats' bit patterns, as the compiled count reads them: every rank of rows with ties, zeros,
    tiny and huge values, in both widths."""
    from h2o_stream.engine.compiled_counts import _kth_smallest

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 64, 257):
        rows = (
            rng.random(n),
            rng.integers(0, 3, n).astype(np.float32),
            np.zeros(n),
            np.arange(n, 0, -1.0),
            (rng.random(n) ** 40).astype(np.float32),  # subnormals among them
            np.float64(1e300) * rng.integers(0, 2, n),
        )
        for row in rows:
            patterns = row.view(np.int32 if row.dtype == np.float32 else np.int64)
            top_bit = row.dtype.itemsize * 8 - 2
            found = [_kth_smallest(patterns, k, top_bit, np.empty_like(patterns)) for k in range(n)]
            assert found == np.sort(patterns).tolist()


def test_scissorhands_chunks_are_the_same_compiled_and_on_tensors(monkeypatch):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(90)
    runs = []
    for compiled in ("0", "1"):
        monkeypatch.setenv("H2O_STREAM_COMPILED", compiled)
        cache = StreamingCache(model, make_policy("scissorhands", 16, heavy=12, recent=4, history=6, quantile=0.75))
        logits = torch.cat([model(ids[:, i : i + 4], cache=cache).logits for i in range(0, 90, 4)], dim=1)
        runs.append((logits, [layer.positions for layer in cache.layers], cache.evicted))
    (tensor, tensor_kept, evicted), (compiled_logits, compiled_kept, compiled_evicted) = runs
    assert evicted > 0 and compiled_evicted == evicted
    assert torch.equal(compiled_logits, tensor)
    assert all(torch.equal(a, b) for a, b in zip(compiled_kept, tensor_kept, strict=True))


def test_the_default_split_keeps_the_official_recent_window_of_ten():
    policy = make_policy("scissorhands", 256)
    assert (policy.heavy, policy.recent, policy.history, policy.quantile) == (246, 10, 100, 0.9)
    assert policy.drop_one() is None and policy.cuts_nest  # tensor path; one fixed order of the counts


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--history", 0, "history (scissorhands' history window) must be a whole number in (0, 65536], got 0"),
        ("--quantile", 0, "quantile (scissorhands' importance quantile) must be a number in (0, 1], got 0.0"),
        ("--quantile", 1.5, "quantile (scissorhands' importance quantile) must be a number in (0, 1], got 1.5"),
    ],
)
def test_bad_settings_are_refused_with_one_error(ppl_model_dir, tmp_path, capsys, option, value, message):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = ["--model", ppl_model_dir, "--data", corpus, "--tokens", 40, "--cache-size", 16, "--out", tmp_path / "o"]
    assert message in ppl_error(capsys, *args, "--policy", "scissorhands", option, value)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("arrived", [1, 3, 5, 7])
def test_window_scores_move_on_by_the_queries_that_arrived(arrived):
    """A "window" score keeps what the latest `history` queries gave, oldest first: the columns move left by the
    queries that arrived, in place, whether the scores are one contiguous block (moved as one flat array) or not."""
    policy = make_policy("scissorhands", 16, heavy=12, recent=4, history=5)
    generator = torch.Generator().manual_seed(arrived)
    before = torch.rand(2, 3, 7, 5, generator=generator, dtype=torch.float64)
    received = torch.rand(2, 3, 7, arrived, generator=generator, dtype=torch.float64)
    expected = torch.cat([before, received], dim=-1)[..., -5:]
    contiguous = before.clone()
    strided = torch.zeros(2, 3, 7, 9, dtype=torch.float64)[..., 2:7]
    strided.copy_(before)
    for scores in (contiguous, strided):
        policy.update_scores(scores, received, steps=arrived)
        assert torch.equal(scores, expected)
    assert not strided.is_contiguous()
