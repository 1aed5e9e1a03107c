"""Scanned forwards (`StreamingCache(decide_every=k)`): one wide forward decides every k tokens inside each layer, and
equals feeding those blocks one forward each (docs/design.md, "Scanned forwards")."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import StreamingCache
from h2o_stream.engine.policies import POLICIES
from h2o_stream.engine.policies.ranking import OWN_SCORE
from h2o_stream.errors import H2OStreamError
from support.oracle import stream_for
from support.policy_matrix import BANDED, EVICTING, build
from support.tiny_models import VOCAB, random_ids, tiny_model

UNBANDED = [name for name in EVICTING if name not in BANDED]


@pytest.fixture(autouse=True)
def _tensor_operations(monkeypatch):
    """The scans here are checked on the tensor operations, bit for bit where they must be; a reference fed one
    forward per block would otherwise take its one-token blocks through the compiled loop (its own rounding;
    tests/engine/test_compiled.py checks that loop, scanned and not)."""
    monkeypatch.setenv("H2O_STREAM_COMPILED", "0")


def _grid_pieces(seen: int, length: int, step: int) -> list[int]:
    """The forwards a scan of `length` tokens stands for: cut at multiples of `step` of the tokens seen."""
    sizes, done = [], 0
    while done < length:
        sizes.append(min(step - (seen + done) % step, length - done))
        done += sizes[-1]
    return sizes


def _feed_both(policy, *, kv_heads, rolling, step, forward, wide_chunks=False, length=None):
    """Feed one stream through a scanned cache (forwards of `forward` tokens) and through a plain cache (one forward
    per block); yield both caches and logits after every wide forward."""
    budget = 8
    spec = build(policy, budget)
    # float64, so that the only difference left (rounding of wider matrix products) is far below the tolerance
    model = tiny_model("llama", num_key_value_heads=kv_heads, init_std=0.2).double()
    scanned = StreamingCache(model, spec, rolling=rolling, wide_chunks=wide_chunks, decide_every=step)
    plain = StreamingCache(model, spec, rolling=rolling, wide_chunks=wide_chunks)
    ids = stream_for(spec, length or 10 * budget, seed=kv_heads + step, vocab=VOCAB)
    for start in range(0, ids.shape[1], forward):
        piece = ids[:, start : start + forward]
        wide_logits = model(piece, cache=scanned).logits[0]
        logits, offset = [], 0
        for size in _grid_pieces(start, piece.shape[1], step):
            logits.append(model(piece[:, offset : offset + size], cache=plain).logits[0])
            offset += size
        yield scanned, plain, wide_logits, torch.cat(logits)


def _tolerance(policy) -> float:
    """Bit for bit but for rounding of wider products (1e-9), or 1e-5 for a policy with a per-layer schedule: a layer
    on slots of its own is moved there from where the model rotated its tokens (un-rotated and rotated again by the
    roller's tables), and a scan moves by other distances than one forward per block does; the model's rotary runs
    in float32, so each move rounds at ~1e-7."""
    return 1e-9 if POLICIES[policy].layer_schedule is None else 1e-5


def _same_entries(scanned, plain):
    atol = _tolerance(scanned.policy.name)
    for mine, theirs in zip(scanned.layers, plain.layers, strict=True):
        assert torch.equal(mine.positions, theirs.positions)
        assert torch.allclose(mine.keys, theirs.keys, atol=atol)
        assert (mine.scores is None) == (theirs.scores is None) == (not mine.policy.needs_scores)
        if mine.scores is not None:
            assert torch.allclose(mine.scores, theirs.scores, atol=atol)


@pytest.mark.parametrize("policy", UNBANDED)
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("rolling", [True, False], ids=["rolling", "no-rolling"])
def test_a_scan_equals_its_blocks_fed_one_forward_each(policy, kv_heads, rolling):
    """Blocks of 3 in forwards of 7 (so blocks straddle forwards, as chunks straddle books in `ppl`): the logits of
    every token and the kept entries, keys and scores of every layer after every forward, over 10x the budget."""
    evicted = False
    for scanned, plain, wide, blocks in _feed_both(policy, kv_heads=kv_heads, rolling=rolling, step=3, forward=7):
        assert torch.allclose(wide, blocks, atol=_tolerance(policy), rtol=0)
        _same_entries(scanned, plain)
        evicted = evicted or scanned.evicted > 0
    assert evicted and scanned.evicted == plain.evicted
    assert scanned.max_keys_seen == plain.max_keys_seen == max(p.budget for p in scanned.layer_policies) + 1


@pytest.mark.parametrize("policy", UNBANDED)
def test_a_scan_of_single_tokens_is_exact_mode(policy):
    for scanned, plain, wide, tokens in _feed_both(policy, kv_heads=2, rolling=True, step=1, forward=16):
        assert torch.allclose(wide, tokens, atol=_tolerance(policy), rtol=0)
        _same_entries(scanned, plain)


def test_a_scan_with_wide_chunks_equals_its_blocks():
    for scanned, plain, wide, blocks in _feed_both(
        "h2o", kv_heads=2, rolling=True, step=4, forward=12, wide_chunks=True
    ):
        assert torch.allclose(wide, blocks, atol=1e-9, rtol=0)
        _same_entries(scanned, plain)
    assert scanned.max_keys_seen == 8 + 4


def test_the_scan_is_really_taken_and_band_policies_skip_it(monkeypatch):
    """A scanned forward runs one attention per block; a band policy (exact at any width) runs one per forward."""
    from h2o_stream.engine import hooks

    calls = []
    scan = hooks._scan
    monkeypatch.setattr(hooks, "_scan", lambda layer, *a: calls.append(list(layer.plan.blocks)) or scan(layer, *a))
    model = tiny_model("llama")
    ids = random_ids(20)
    model(ids, cache=StreamingCache(model, build("h2o", 8), decide_every=4))
    assert calls and all(blocks == [4] * 5 for blocks in calls)
    calls.clear()
    model(ids, cache=StreamingCache(model, build("sink", 8), decide_every=4))
    assert calls == []


def _cut_trials(spec, seed: int, *, reductions: int, equal_keys: bool = False):
    """40 layers' bookkeeping for `spec` at budget 16 (17-20 entries, few score values: many ties) and the cut of
    each (`reduced`, down to 16 + 1 - reductions): yields (positions, scores, needed extras, reduced policy)."""
    generator = torch.Generator().manual_seed(seed)
    for trial in range(40):
        n, kept = 17 + trial % 4, 16 - trial % reductions  # a fair chunk's cut: from up to budget + C entries
        positions = torch.arange(100, 100 + n).expand(2, 3, n)  # ascending stream positions, as the cache keeps them
        moments = spec.score_moments  # roco: sums and sums of squares; snapkv: one column per observed query
        scores = torch.randint(0, 4, (2, 3, n, *moments), generator=generator).double()  # few values: many ties
        extra = {
            "keys": torch.randn(2, 3, n, 4, generator=generator, dtype=torch.float64),
            "values": torch.randn(2, 3, n, 4, generator=generator, dtype=torch.float64),
            "tokens": torch.randint(0, 8, (2, 3, n), generator=generator),
            "layer": 0,  # head_hybrid's example classes head 0 of every layer retrieval, the others streaming
        }  # ids 3 and 4 are separators
        if equal_keys:
            extra["keys"][:, :, 9] = extra["keys"][:, :, 5]  # equal similarities (keydiff), the older one first
        taken = {k: v for k, v in extra.items() if getattr(spec, f"needs_{k}")}
        yield positions, scores, taken, spec.reduced(kept)


def _keep_among(p, slots, positions, scores, taken):
    """p's choice among the entries at `slots` (1-D), as slots of that subset."""
    return p.keep(
        positions[..., slots],
        scores[:, :, slots] if p.needs_scores else None,
        **{k: v if k == "layer" else v[:, :, slots] for k, v in taken.items()},
    )


@pytest.mark.parametrize("policy", UNBANDED)
def test_policies_that_declare_nesting_cuts_keep_the_same_with_one_cut(policy):
    """`cuts_nest`: cutting to the budget, then with `reduced(b)`, keeps what one cut with `reduced(b)` keeps, for
    streams with tied scores; a policy that does not declare it (keydiff) is shown not to have it. A policy ranking by
    its own `score()` is cut twice between chunks, whatever its score reads."""
    spec = build(policy, 16)
    nested_everywhere = True
    for positions, scores, taken, reduced in _cut_trials(spec, 7, reductions=12):
        everything = torch.arange(positions.shape[-1])
        first = spec.keep(positions, scores if spec.needs_scores else None, **taken)
        for b in range(2):
            for h in range(3):
                survivors = first[b, h]
                twice = survivors[_keep_among(reduced, survivors, positions, scores, taken)[b, h]]
                once = _keep_among(reduced, everything, positions, scores, taken)[b, h]
                nested_everywhere = nested_everywhere and torch.equal(twice, once)
    if spec.ranking is OWN_SCORE:  # a score of the policy's own may read what else is held: never declared to nest
        assert not spec.cuts_nest
    else:
        assert nested_everywhere == spec.cuts_nest


@pytest.mark.parametrize("policy", UNBANDED)
def test_keeping_twice_at_once_keeps_what_two_cuts_keep(policy):
    """`keep_twice` (a cut to the budget and, at once, one with `reduced(b)`) keeps what cutting twice keeps, for
    every policy without a band: tied scores, duplicated keys (keydiff's equal similarities) and reductions down to
    the sinks alone, where keydiff answers the plain way."""
    spec = build(policy, 16)
    for positions, scores, taken, reduced in _cut_trials(spec, 11, reductions=15, equal_keys=True):
        given = scores if spec.needs_scores else None
        first = spec.keep(positions, given, **taken)
        both = spec.keep_twice(reduced, positions, given, **taken)
        for b in range(2):
            for h in range(3):
                survivors = first[b, h]
                twice = survivors[_keep_among(reduced, survivors, positions, scores, taken)[b, h]]
                assert torch.equal(both[b, h], twice), (reduced.describe(), b, h)


@pytest.mark.parametrize("policy, both_at_once", [("h2o", False), ("keydiff", True)])
def test_a_fair_scan_cuts_once_between_blocks(monkeypatch, policy, both_at_once):
    """In a scanned fair forward of 5 blocks over a full cache, every policy cuts once before each block and leaves
    the end's cut (one entry over the budget) to the next forward, or to `settle` when the cache is read. h2o, whose
    cuts nest, cuts with the reduced policy alone; keydiff, whose cuts do not, makes the previous block's cut and its
    own at once (`keep_twice`) from the second block on."""
    from h2o_stream.engine.layer import StreamingLayer

    model = tiny_model("llama")
    cache = StreamingCache(model, build(policy, 8), decide_every=4)
    model(random_ids(8), cache=cache)
    cuts = []
    cut = StreamingLayer._cut

    def counted(layer, p, then=None, **room):
        if layer is cache.layers[0]:
            cuts.append((p.budget, None if then is None else then.budget))
        return cut(layer, p, then, **room)

    monkeypatch.setattr(StreamingLayer, "_cut", counted)
    model(random_ids(20), cache=cache)
    assert cuts == [(5, None)] + [(8, 5) if both_at_once else (5, None)] * 4
    assert all(layer.slots == 9 and layer.cut_pending for layer in cache.layers)
    assert cache.slots == 8 and cuts[-1] == (8, None)  # reading the cache settles it
    assert all(layer.slots == 8 and not layer.cut_pending for layer in cache.layers)


def test_decide_every_is_checked():
    model = tiny_model("llama")
    with pytest.raises(H2OStreamError, match="at least 1"):
        StreamingCache(model, build("h2o", 8), decide_every=0)
    with pytest.raises(H2OStreamError, match="a chunk of 9 tokens over a cache of 8"):
        StreamingCache(model, build("h2o", 8), decide_every=9)


@pytest.mark.parametrize("reset_per_book", [False, True])
def test_ppl_scans_by_default_with_the_results_of_one_forward_per_chunk(reset_per_book):
    """Books of odd lengths, so chunks straddle book ends (two forwards in the plain run, two blocks in the scan)."""
    from h2o_stream.apps.perplexity.run import PerplexityRun
    from h2o_stream.apps.perplexity.stream import token_pieces
    from support.tiny_models import char_tokenizer

    model, tokenizer = tiny_model("llama", init_std=0.2).double(), char_tokenizer()
    text = "The quick brown fox, it said; jumps over the lazy dog.\n" * 12
    books = [text[:301], text[:77], text[:420]]
    runs = {}
    for span in (None, 8):
        run = PerplexityRun(
            model, build("tova", 32), chunk_size=8, span=span, reset_per_book=reset_per_book, record_tokens=True
        )
        run.run(token_pieces(books, tokenizer))
        runs[run.span] = run
    scanned, plain = runs[256], runs[8]
    assert scanned.cache.decide_every == 8 and plain.cache.decide_every is None
    assert torch.allclose(torch.cat(scanned.token_nll), torch.cat(plain.token_nll), atol=1e-9, rtol=0)
    assert scanned.result().span == 256 and scanned.settings == plain.settings  # speed only: same settings
    assert scanned.cache.evicted == plain.cache.evicted > 0


def test_a_scanned_cache_takes_forwards_wider_than_its_budget():
    """Decisions, not forwards, are what the budget limits: `feed` sends 40-token forwards into a cache of 8."""
    from h2o_stream.engine.feed import feed

    model = tiny_model("llama").double()
    ids = random_ids(120)
    scanned = StreamingCache(model, build("h2o", 8), decide_every=4)
    plain = StreamingCache(model, build("h2o", 8))
    assert scanned.max_chunk is None and plain.max_chunk == 8
    wide = feed(model, scanned, ids, 40)
    unscanned = StreamingCache(model, build("h2o", 8))
    model(ids[:, :8], cache=unscanned)
    with pytest.raises(H2OStreamError, match="at most the cache size"):
        model(ids[:, 8:48], cache=unscanned)
    assert torch.allclose(wide, feed(model, plain, ids, 4), atol=1e-9, rtol=0)
    _same_entries(scanned, plain)
