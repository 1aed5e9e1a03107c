"""Families whose layers attend differently (tiny random configs: tests/support/tiny_models.py HYBRID_FAMILIES):
Gemma 2 and 3, Mistral and Qwen2 with sliding windows, Cohere2, GPT-OSS. A full cache streams equal to the model's own
forward (its sliding masks included), chunked sinks equal exact sinks, rolling does not drift, every policy runs, and
each layer holds what docs/design.md ("Layers that attend differently") says."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from h2o_stream import H2OStreamError, StreamingCache, make_policy
from h2o_stream.engine import hooks
from h2o_stream.engine.layer_types import layer_windows
from h2o_stream.engine.plan import LayerPlan
from h2o_stream.engine.policies import POLICIES
from support.policy_matrix import ALL, build
from support.tiny_models import HYBRID_FAMILIES, WINDOW, random_ids, tiny_model

FAMILIES = sorted(HYBRID_FAMILIES)
FLOAT32_ONLY = {"gpt_oss"}  # its experts' grouped matmul takes no float64


@functools.cache
def model_of(family: str, dtype: str = "float64"):
    """One tiny model per family and dtype for the whole module (models are only read; the one test that changes
    a config builds its own)."""
    model = tiny_model(family)
    return model if family in FLOAT32_ONLY or dtype == "float32" else model.double()


def tolerance(family: str) -> float:
    return 1e-4 if family in FLOAT32_ONLY else 1e-6


def stream(model, cache, ids, chunk: int) -> torch.Tensor:
    """(length, vocab) logits of `ids` fed `chunk` tokens per forward."""
    with torch.no_grad():
        return torch.cat([model(ids[:, s : s + chunk], cache=cache).logits[0] for s in range(0, ids.shape[1], chunk)])


def slides(model) -> list[bool]:
    return [w is not None for w in layer_windows(model.config.get_text_config(decoder=True))]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [1, 5, 48])
def test_a_full_cache_streams_equal_to_the_models_own_forward(family, chunk):
    model = model_of(family)
    ids = random_ids(48)  # six windows long: every sliding layer slides
    with torch.no_grad():
        reference = model(ids).logits[0]
    cache = StreamingCache(model, make_policy("full"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fast path declining soft-capping or sink logits says so; tested below
        streamed = stream(model, cache, ids, chunk)
    assert (streamed - reference).abs().max() < tolerance(family)
    held = [layer.slots for layer in cache.layers]
    sliding = slides(model)
    assert any(sliding) and held == [WINDOW - 1 if s else 48 for s in sliding]  # a sliding layer: its window
    assert cache.entries == sum(held)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [5, 12])  # below and above a sliding layer's window - 1
def test_chunked_sinks_equal_exact_sinks(family, budget):
    model = model_of(family)
    ids = random_ids(60)
    exact_cache = StreamingCache(model, make_policy("sink", budget, sinks=2))
    chunked_cache = StreamingCache(model, make_policy("sink", budget, sinks=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = stream(model, exact_cache, ids, 1)
        chunked = stream(model, chunked_cache, ids, 16)
    exact_nll = torch.nn.functional.cross_entropy(exact[:-1].double(), ids[0, 1:], reduction="none")
    chunked_nll = torch.nn.functional.cross_entropy(chunked[:-1].double(), ids[0, 1:], reduction="none")
    assert (exact_nll - chunked_nll).abs().max() < 1e-4
    assert [a.positions.tolist() for a in exact_cache.layers] == [b.positions.tolist() for b in chunked_cache.layers]


@pytest.mark.parametrize("family", ["gemma3_text", "cohere2", "gpt_oss"])
def test_rolling_does_not_drift_over_a_periodic_stream(family):
    """A periodic stream through a sink cache: once warm, every layer holds the same tokens at the same slots one
    period later, so the logits repeat; keys re-rotated hundreds of times (and moved to a sliding layer's own
    slots) would drift apart."""
    model = model_of(family)
    period, budget = 7, 12
    ids = random_ids(period).repeat(1, 100)  # 700 tokens
    cache = StreamingCache(model, make_policy("sink", budget, sinks=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = stream(model, cache, ids, 64)
    warm = 8 * period  # beyond every window and the depth of the model
    assert (logits[warm : warm + period] - logits[-period:]).abs().max() < tolerance(family) * 10


def test_keys_moved_to_a_sliding_layers_slots_do_not_drift_over_long_rolling():
    """A Gemma 3 sliding layer running h2o (sliding="policy") beside a global layer whose slots jump: 4,000 keys
    arrive rotated at the global layer's positions, are moved to the sliding layer's own slots and re-rotated at
    every step, heavy hitters for thousands of steps; the keys in use equal the raw keys rotated straight to their
    slot with the local rotary table."""
    model = model_of("gemma3_text")
    cache = StreamingCache(model, make_policy("h2o", 6), sliding="policy")
    layer, roller = cache.layers[0], cache.layers[0].roller
    generator = torch.Generator().manual_seed(0)
    heads, dim, steps = 1, 16, 4_000
    raw_keys = torch.randn(steps, heads, dim, generator=generator, dtype=torch.float64) * 3
    value = torch.zeros(1, heads, 1, 4, dtype=torch.float64)
    for t in range(steps):
        given = int(torch.randint(0, 17, (1,), generator=generator))  # where the global layer's slots put it
        layer.begin(LayerPlan(1, moved=(range(given, given + 1), range(layer.slots, layer.slots + 1))))
        keys_in_use, _ = layer.update(roller.rotate(raw_keys[t].view(1, heads, 1, dim), given, given + 1), value)
        # random attention makes survivors (and so every key's slot) jump around, as H2O does
        layer.after_attention(torch.rand(1, heads, keys_in_use.shape[-2], generator=generator, dtype=torch.float64))
    assert layer.slots == 6 and layer.positions.min() < steps // 2  # old heavy hitters, renumbered many times
    layer.begin(LayerPlan(1))
    keys, _ = layer.update(roller.rotate(raw_keys[0].view(1, heads, 1, dim), 6, 7), value)
    for slot, position in enumerate(layer.positions[0, 0].tolist()[:-1]):
        fresh = roller.rotate(raw_keys[position, 0].view(1, 1, 1, dim), slot, slot + 1)[0, 0, 0]
        assert (keys[0, 0, slot] - fresh).norm() <= 1e-5 * fresh.norm()


def expected_layer(name: str, budget: int, fed: int, slide: bool, every_layer_slides: bool) -> tuple[str, int]:
    """(policy name, entries held) of a layer by docs/design.md: a sliding layer keeps its window beside global
    layers; where every layer slides, each runs the policy (the full cache as the window)."""
    if slide and (not every_layer_slides or name == "full"):
        return "window", WINDOW - 1
    return name, fed if name == "full" else budget


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", [name for name in ALL if POLICIES[name].layer_schedule is None])  # test_pyramid.py
def test_every_policy_runs_and_each_layer_holds_its_share(family, name):
    model = model_of(family, "float32")
    budget, fed = 6, 30
    cache = StreamingCache(model, build(name, None if name == "full" else budget))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = stream(model, cache, random_ids(fed), 1 if name in ("tova", "roco") else 3)
    assert torch.isfinite(logits).all()
    cache.settle()  # a fair chunk may leave its last cut to the next forward
    sliding = slides(model)
    held = [(layer.policy.name, layer.slots) for layer in cache.layers]
    assert held == [expected_layer(name, budget, fed, slide, all(sliding)) for slide in sliding]
    assert cache.entries == sum(slots for _, slots in held)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen2_sliding"])
def test_sliding_policy_runs_the_policy_on_every_layer_capped_at_the_window(family):
    model = model_of(family)
    ids = random_ids(40)
    for budget, expected in [(4, 4), (20, WINDOW - 1)]:
        cache = StreamingCache(model, make_policy("h2o", budget), sliding="policy")
        stream(model, cache, ids, 1)
        for layer, slide in zip(cache.layers, slides(model), strict=True):
            assert layer.policy.name == "h2o"
            assert layer.slots == (expected if slide else budget)
        assert cache.state()["sliding"] == "policy"


def test_a_checkpoint_of_one_sliding_mode_is_refused_by_the_other():
    model = model_of("gemma3_text")
    cache = StreamingCache(model, make_policy("sink", 6))
    stream(model, cache, random_ids(20), 4)
    other = StreamingCache(model, make_policy("sink", 6), sliding="policy")
    with pytest.raises(H2OStreamError, match="sliding layers 'window', not 'policy'"):
        other.load_state(cache.state())


def test_an_unknown_sliding_mode_and_layer_type_are_refused():
    model = tiny_model("gemma3_text")
    with pytest.raises(H2OStreamError, match="keep their window or run the policy"):
        StreamingCache(model, make_policy("sink", 6), sliding="all")
    model.config.layer_types = ["chunked_attention"] * 3
    with pytest.raises(H2OStreamError, match="layers of type chunked_attention are not supported"):
        StreamingCache(model, make_policy("sink", 6))


@pytest.mark.parametrize(
    "family, reason",
    [("gemma2", "logit soft-capping"), ("gpt_oss", "learned sink logits"), ("cohere2", "interleaved rotary pairs")],
)
def test_the_compiled_loop_declines_what_it_cannot_take_and_says_so_once(family, reason, monkeypatch):
    monkeypatch.setattr(hooks, "_said", set())
    monkeypatch.setenv("H2O_STREAM_COMPILED", "1")
    model = model_of(family)
    ids = random_ids(20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = stream(model, StreamingCache(model, make_policy("h2o", 6)), ids, 1)
    said = [str(w.message) for w in caught if "compiled exact-mode loop" in str(w.message)]
    assert len(said) == 1 and reason in said[0]
    monkeypatch.setenv("H2O_STREAM_COMPILED", "0")
    tensor = stream(model, StreamingCache(model, make_policy("h2o", 6)), ids, 1)
    assert (compiled - tensor).abs().max() < tolerance(family)


def test_gemma3_layers_roll_with_their_own_rotary_tables():
    model = model_of("gemma3_text")
    cache = StreamingCache(model, make_policy("sink", 6))
    rollers = [layer.roller for layer in cache.layers]
    assert rollers[0] is rollers[2] and rollers[0] is not rollers[1]
    assert (rollers[0].layer_type, rollers[1].layer_type) == ("sliding_attention", "full_attention")
    local, glob = (r.table(64, torch.device("cpu"))["cos"] for r in rollers[:2])
    assert not torch.allclose(local, glob)  # another base, and linear scaling on the global layer


def test_cohere2_global_layers_have_no_positions_to_roll():
    cache = StreamingCache(model_of("cohere2"), make_policy("sink", 6))
    assert [layer.roller is None for layer in cache.layers] == [False, True, False]


def test_rows_of_a_hybrid_model_equal_each_cache_alone():
    from h2o_stream.engine import RowsCache

    model = model_of("gemma3_text")
    ids = random_ids(40)
    policies = [make_policy("sink", 5, sinks=2), make_policy("h2o", 12), make_policy("full")]
    alone = [stream(model, StreamingCache(model, p), ids, 4) for p in policies]
    caches = [StreamingCache(model, p, decide_every=None) for p in policies]
    rows = RowsCache(model, caches)
    with torch.no_grad():
        together = torch.cat(
            [model(ids[:, s : s + 4].expand(3, -1), cache=rows).logits for s in range(0, 40, 4)], dim=1
        )
    for row, logits in enumerate(alone):
        assert (together[row] - logits).abs().max() < 1e-6
