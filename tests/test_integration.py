"""The real default model (SmolLM2-135M-Instruct) on real text: the Gutenberg sample shipped with the package."""

from __future__ import annotations

import math

import pytest
import torch

from h2o_stream import stream_perplexity
from h2o_stream.loading.corpus import book_token_ids, iter_books

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_model():
    from h2o_stream.loading.models import load_model

    return load_model(None)


@pytest.fixture(scope="module")
def book_tokens(default_model):
    # Skip the front matter (title page, contents) of the first book: prose is what the comparison is about.
    book = next(iter_books("sample"))
    return torch.tensor(book_token_ids(book, default_model.tokenizer)[20_000:23_000])


def test_h2o_and_sink_run_in_exact_mode_with_finite_nll(default_model, book_tokens):
    for policy in ("h2o", "sink"):
        result = stream_perplexity(
            default_model.model, None, book_tokens[:600], policy=policy, cache_size=64, chunk_size=1
        )
        assert result.predicted == 599 and math.isfinite(result.mean_nll), policy
        assert 1 < result.ppl < 200, (policy, result.ppl)


def test_full_cache_beats_sinks_beats_window_without_rolling(default_model, book_tokens):
    model = default_model.model
    full = stream_perplexity(model, None, book_tokens, policy="full", chunk_size=256)
    sink = stream_perplexity(model, None, book_tokens, policy="sink", cache_size=128, chunk_size=256)
    window = stream_perplexity(model, None, book_tokens, policy="window", cache_size=128, chunk_size=256, rolling=False)
    print(f"\nfull {full.ppl:.3f}  sink-128 {sink.ppl:.3f}  window-128 without rolling {window.ppl:.3f}")
    assert full.ppl <= sink.ppl <= window.ppl
