"""The engine's remaining refusals and the small parts of `RowsCache` and `feed` no other test reaches: an empty
RowsCache, a RowsCache filled by a forward h2o-stream did not set up, what a RowsCache reports and how it resets, and
`feed` given one-dimensional or empty ids."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import H2OStreamError, StreamingCache, make_policy
from h2o_stream.engine import RowsCache
from h2o_stream.engine.feed import feed
from support.cache_state import assert_untouched, snapshot
from support.tiny_models import VOCAB, random_ids, tiny_model


def two_rows(model) -> tuple[RowsCache, list[StreamingCache]]:
    caches = [StreamingCache(model, make_policy("h2o", 8)), StreamingCache(model, make_policy("sink", 12))]
    return RowsCache(model, caches), caches


# -- RowsCache refusals ------------------------------------------------------------------------------------------------


def test_a_rows_cache_without_caches_is_refused():
    with pytest.raises(H2OStreamError, match="needs at least one StreamingCache"):
        RowsCache(tiny_model("llama"), [])


def test_a_rows_cache_filled_by_a_forward_h2o_stream_did_not_set_up_is_refused():
    """A model of the same shape that was never attached (no hooks) runs its own attention, which calls
    `update` directly: refused before any row changes, and the rows still work with their own model."""
    model, stranger = tiny_model("llama"), tiny_model("llama", seed=1)
    batch, caches = two_rows(model)
    ids = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    model(ids, cache=batch)
    before = [snapshot(cache) for cache in caches]
    with pytest.raises(H2OStreamError, match="RowsCache is being filled by a forward that h2o-stream did not set up"):
        stranger(ids, cache=batch)
    for cache, state in zip(caches, before, strict=True):
        assert_untouched(cache, state)
    with pytest.raises(H2OStreamError, match="did not set up"):  # and outside any forward
        batch.update(torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 0)
    model(ids, cache=batch)
    assert [cache.seen for cache in caches] == [10, 10]


# -- what a RowsCache reports, and its resets --------------------------------------------------------------------------


def test_a_rows_cache_reports_the_largest_budget_of_its_rows():
    batch, _ = two_rows(tiny_model("llama"))
    assert batch.get_max_length() == 12
    assert [layer.get_max_length() for layer in batch.layers] == [12, 12]


def test_a_rows_cache_with_an_unbounded_row_has_no_maximum_length():
    model = tiny_model("llama")
    batch = RowsCache(
        model, [StreamingCache(model, make_policy("full", None)), StreamingCache(model, make_policy("h2o", 8))]
    )
    assert StreamingCache(model, make_policy("full", None)).get_max_length() == -1
    assert batch.get_max_length() == -1  # not the bounded row's 8: the unbounded row grows past it


def test_early_initialization_marks_the_rows_layers_and_leaves_each_row_to_initialise_itself():
    model = tiny_model("llama")
    batch, caches = two_rows(model)
    assert not batch.is_initialized
    batch.early_initialization(2, 2, 16, torch.float32, torch.device("cpu"))
    assert batch.is_initialized
    assert all(not row.is_initialized and row.keys is None for cache in caches for row in cache.layers)
    model(torch.randint(2, VOCAB, (2, 5)), cache=batch)  # each row initialises itself on its first entries
    assert all(row.is_initialized and row.slots == 5 for cache in caches for row in cache.layers)


def test_reset_empties_every_row_and_the_rows_go_on():
    model = tiny_model("llama")
    batch, caches = two_rows(model)
    ids = torch.randint(2, VOCAB, (2, 6))
    model(ids, cache=batch)
    assert [cache.seen for cache in caches] == [6, 6]
    batch.reset()
    assert [cache.seen for cache in caches] == [0, 0] and batch.get_seq_length() == 0
    assert all(row.keys is None and not row.is_initialized for cache in caches for row in cache.layers)
    model(ids, cache=batch)
    assert [cache.seen for cache in caches] == [6, 6]


def test_resetting_one_layer_of_a_rows_cache_resets_that_layer_of_every_row():
    model = tiny_model("llama")
    batch, caches = two_rows(model)
    model(torch.randint(2, VOCAB, (2, 6)), cache=batch)
    first = batch.layers[0]
    assert all(pair is not None for pair in first.attend_to)
    first.reset()
    assert first.attend_to == [None, None]
    assert all(cache.layers[0].seen == 0 and cache.layers[0].keys is None for cache in caches)
    assert all(cache.layers[1].seen == 6 for cache in caches)  # the other layer keeps its entries


# -- feed --------------------------------------------------------------------------------------------------------------


def test_feed_takes_one_dimensional_ids_as_one_stream():
    model = tiny_model("llama")
    ids = random_ids(9)
    flat_cache, batched_cache = (
        StreamingCache(model, make_policy("h2o", 4)),
        StreamingCache(model, make_policy("h2o", 4)),
    )
    flat = feed(model, flat_cache, ids[0], 4)
    assert torch.equal(flat, feed(model, batched_cache, ids, 4))
    assert flat.shape == (VOCAB,) and flat_cache.seen == 9


def test_feed_refuses_empty_ids_with_the_cache_untouched():
    model = tiny_model("llama")
    cache = StreamingCache(model, make_policy("h2o", 4))
    model(random_ids(3), cache=cache)
    before = snapshot(cache)
    for empty in (torch.empty(0, dtype=torch.long), torch.empty(1, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match="feed\\(\\) needs at least one token"):
            feed(model, cache, empty)
        assert_untouched(cache, before)
