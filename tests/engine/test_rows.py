"""Runs as the rows of one batch (`RowsCache`, `RunRows`, `ppl --rows`): every row equals its cache or run alone."""

from __future__ import annotations

import json

import pytest
import torch

from h2o_stream import StreamingCache
from h2o_stream.apps.perplexity.rows import RunRows
from h2o_stream.apps.perplexity.run import PerplexityRun
from h2o_stream.apps.perplexity.stream import token_pieces
from h2o_stream.engine import RowsCache
from h2o_stream.errors import H2OStreamError
from support.policy_matrix import ALL, build
from support.ppl_helpers import assert_same_runs, ppl_command, run_to_end, write_corpus
from support.tiny_models import VOCAB, tiny_model


def _row_caches(model, spread: int = 0) -> list[StreamingCache]:
    """One cache per registered policy, with budgets, decision steps and rolling spread over the rows."""
    caches = []
    for i, name in enumerate(ALL):
        budget = (8, 12)[(i + spread) % 2]
        policy = build(name, budget if build(name, budget).budget is not None else None)
        decide_every = (None, 1, 3)[(i + spread) % 3]
        caches.append(StreamingCache(model, policy, rolling=(i + spread) % 4 != 3, decide_every=decide_every))
    return caches


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("spread", [0, 1])
def test_each_row_equals_its_cache_alone(kv_heads, spread):
    """Every registered policy in one batch (budgets 8/12, exact, scanned and one-forward chunks, rolling on and off),
    over 10x the budget in forwards of 5: each row's logits and kept entries equal its cache fed alone."""
    model = tiny_model("llama", num_key_value_heads=kv_heads, init_std=0.2).double()
    rows, alone = _row_caches(model, spread), _row_caches(model, spread)
    batch = RowsCache(model, rows)
    # distinct tokens: keydiff ranks keys, and two copies of a token would tie (see oracle.stream_for)
    ids = (torch.randperm(VOCAB - 2, generator=torch.Generator().manual_seed(spread))[:90] + 2).unsqueeze(0)
    evicted = False
    for start in range(0, ids.shape[1], 5):
        piece = ids[:, start : start + 5]
        logits = model(piece.expand(len(rows), -1), cache=batch).logits
        for i, cache in enumerate(alone):
            assert torch.allclose(logits[i], model(piece, cache=cache).logits[0], atol=1e-9), cache.policy.describe()
            for mine, theirs in zip(rows[i].layers, cache.layers, strict=True):
                assert torch.equal(mine.positions, theirs.positions)
                assert (mine.scores is None) == (theirs.scores is None) == (not mine.policy.needs_scores)
                if mine.scores is not None:
                    assert torch.allclose(mine.scores, theirs.scores, atol=1e-9)
        evicted = evicted or any(cache.evicted for cache in rows)
    assert evicted


def test_misfits_are_refused_with_every_cache_untouched():
    model = tiny_model("llama", num_key_value_heads=2)
    wide, narrow = StreamingCache(model, build("h2o", 16)), StreamingCache(model, build("h2o", 4))
    batch = RowsCache(model, [wide, narrow])
    ids = torch.randint(2, VOCAB, (2, 6))
    model(ids, cache=batch)
    before = [layer.state() for cache in (wide, narrow) for layer in cache.layers]
    with pytest.raises(H2OStreamError, match="chunk of 6 tokens over a cache of 4"):
        model(ids, cache=batch)  # the second row's chunk is wider than its cache: neither row may change
    after = [layer.state() for cache in (wide, narrow) for layer in cache.layers]
    for old, new in zip(before, after, strict=True):
        assert all(torch.equal(old[k], new[k]) if isinstance(old[k], torch.Tensor) else old[k] == new[k] for k in old)
    with pytest.raises(H2OStreamError, match="has 2 rows and the forward brings a batch of 3"):
        model(torch.randint(2, VOCAB, (3, 2)), cache=batch)
    with pytest.raises(H2OStreamError, match="its own StreamingCache"):
        RowsCache(model, [wide, wide])
    with pytest.raises(H2OStreamError, match="made for another model"):
        RowsCache(tiny_model("llama", num_key_value_heads=1), [wide])


def test_runs_as_rows_equal_runs_alone_per_token():
    """PerplexityRuns fed as rows (float32, books carried over, forwards of 32 tokens): the NLL of every token within
    1e-5 on average of each run alone, and the same positions, predictions and kept entries."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    books = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (150, 77, 200)]
    specs = [(build("h2o", 16), 4), (build("sink", 24), 8), (build("tova", 16), 1), (build("sepllm", 24), 8)]

    def runs():
        return [PerplexityRun(model, policy, chunk_size=chunk, span=32, record_tokens=True) for policy, chunk in specs]

    def pieces():
        return iter(list(enumerate(books)))

    together, alone = runs(), runs()
    RunRows(together).run(pieces(), limit=400)
    for run in alone:
        run.run(pieces(), limit=400)
    for mine, theirs in zip(together, alone, strict=True):
        assert mine.position == theirs.position == 400 and mine.predicted == theirs.predicted == 399
        difference = (torch.cat(mine.token_nll) - torch.cat(theirs.token_nll)).abs().mean().item()
        assert difference <= 1e-5, mine.policy.describe()
        for a, b in zip(mine.cache.layers, theirs.cache.layers, strict=True):
            assert torch.equal(a.positions, b.positions)


def test_runs_at_different_places_do_not_ride_together():
    model = tiny_model("llama")
    first, second = (PerplexityRun(model, build("h2o", 16), chunk_size=4, span=16) for _ in range(2))
    first.run(token_pieces(torch.randint(2, VOCAB, (40,))), limit=20)
    with pytest.raises(H2OStreamError, match="differ in position"):
        RunRows([first, second])
    third = PerplexityRun(model, build("h2o", 16), chunk_size=4, span=8)
    with pytest.raises(H2OStreamError, match="differ in span"):
        RunRows([second, third])


def test_ppl_rows_equal_runs_alone_and_resume(ppl_model_dir, tmp_path):
    """`ppl --rows 3` (two groups: one of three runs, one of one) equals the runs alone; a finished rows sweep
    extended with --resume and more --tokens equals one uninterrupted run; --workers 2 --rows 2 also."""
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    args = ["--model", ppl_model_dir, "--data", corpus, "--policy", "h2o,sink", "--cache-size", "16,24", "--threads", 1]
    names = ["h2o-16", "h2o-24", "sink-16", "sink-24"]
    run_to_end(ppl_command(*args, "--tokens", 700, "--out", tmp_path / "alone", "--workers", 1))
    run_to_end(ppl_command(*args, "--tokens", 300, "--out", tmp_path / "rows", "--workers", 1, "--rows", 3))
    run_to_end(ppl_command(*args, "--tokens", 700, "--out", tmp_path / "rows", "--workers", 1, "--rows", 3, "--resume"))
    rows = {name: json.loads((tmp_path / "rows" / f"{name}.json").read_text())["rows"] for name in names}
    assert sorted(rows.values()) == [1, 3, 3, 3]
    assert_same_runs(tmp_path / "alone", tmp_path / "rows", 4, per_token=1e-5)
    done = run_to_end(ppl_command(*args, "--tokens", 700, "--out", tmp_path / "both", "--workers", 2, "--rows", 2))
    assert "4 runs on 2 workers" in done.stderr
    assert_same_runs(tmp_path / "alone", tmp_path / "both", 4, per_token=1e-5)
