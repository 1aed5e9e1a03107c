"""The policy seam: a policy declares its budget parts and settings, and make_policy, the command-line options, the
printed split and the result files follow the registry, so a new policy is one class (here: one defined in this
test); the hooks the policy zoo plugs into (how attention becomes a score, keys and token ids for `keep`, policies
built from a tokenizer); and the refusals, each one clear H2OStreamError."""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
import re
from dataclasses import dataclass

import click
import pytest
import torch
from click.testing import CliRunner

import h2o_stream.engine.policies as policies_package
from h2o_stream import H2OStreamError, StreamingCache, make_policy, register, stream_perplexity
from h2o_stream.engine.attention import attend_with_scores, layer_mean
from h2o_stream.engine.policies import POLICIES, EvictionPolicy, Part
from h2o_stream.engine.policies.base import HEAVY, RECENT, Scores, split_budget
from h2o_stream.engine.policies.h2o import H2OPolicy
from h2o_stream.engine.policies.sepllm import SEPARATOR_PUNCTUATION, SepLLMPolicy, separator_ids
from h2o_stream.engine.policies.slots import ages, keep_top, last_slots, top_slots
from policy_matrix import ALL, BANDED, EVICTING, SCORED, TOKENIZED, build
from tiny_models import random_ids, tiny_model

#: what conftest's `tokenizer` is trained on here: every separator mark, and words without any
TRAINING_TEXTS = [
    "Hello, world. What is two plus two? Four! Then: more; text.\nA new line,\tand a tab.",
    "plain words without any marks at all",
    "one. two, three? four! five; six: seven",
]


# -- the registry and the base class -----------------------------------------------------------------------------


def test_every_policy_class_of_the_policies_folder_is_made_by_its_name():
    """A policy file whose class misses @register would be absent from make_policy, the command line and every test
    drawn from the registry, and nothing else would say so."""
    defined = []
    for found in pkgutil.iter_modules(policies_package.__path__):
        module = importlib.import_module(f"{policies_package.__name__}.{found.name}")
        defined += [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type)
            and issubclass(cls, EvictionPolicy)
            and cls is not EvictionPolicy
            and cls.__module__ == module.__name__
        ]
    assert defined
    for cls in defined:
        cache_size = 16 if cls.parts else None
        assert type(build(cls.name, cache_size)) is cls and POLICIES[cls.name] is cls


def test_every_kind_of_policy_the_other_tests_draw_from_has_one():
    """The tests parametrized by tests/policy_matrix.py over scored, banded, and neither (keys or token ids), and
    over the policies that need a tokenizer, would pass with no case at all if a kind were empty."""
    unscored = set(EVICTING) - set(SCORED) - set(BANDED)
    assert SCORED and BANDED and unscored and TOKENIZED and set(EVICTING) < set(ALL)


@pytest.mark.parametrize(
    "size, given, expected",
    [
        (16, {}, {"fixed": 4, "shared": 8, "rest": 4}),
        (6, {}, {"fixed": 4, "shared": 2, "rest": 0}),  # each default is capped at what is left
        (2, {}, {"fixed": 2, "shared": 0, "rest": 0}),
        (
            16,
            {"rest": 10},
            {"fixed": 4, "shared": 2, "rest": 10},
        ),  # the rest given: the last part not given is the rest
        (16, {"fixed": 1, "shared": 1}, {"fixed": 1, "shared": 1, "rest": 14}),
    ],
)
def test_a_budget_splits_by_the_declared_defaults(size, given, expected):
    parts = (Part("fixed", "f", fixed=4), Part("shared", "s", share=0.5), Part("rest", "r"))
    assert split_budget(parts, size, given) == expected


@dataclass
class HeaviestPolicy(EvictionPolicy):
    """H2O's rule and nothing else, declared: scores summed (the `Scores` defaults), the middle ranked by score."""

    heavy: int
    recent: int
    name = "heaviest"
    parts = (HEAVY, RECENT)
    scoring = Scores()
    ranking = "score"


@pytest.mark.parametrize("chunk", [1, 4], ids=["exact", "chunked"])
@pytest.mark.parametrize("compiled", ["0", "1"], ids=["tensor", "compiled"])
def test_a_scored_policy_that_declares_only_its_rule_scores_as_h2o(chunk, compiled, monkeypatch):
    """`Scores()`'s defaults are H2O's: attention received, summed over the steps, the queries of a chunk and the
    query heads of a KV head. A new policy declaring them and a ranking by score keeps what h2o keeps, token for
    token, on the tensor operations and (exact mode) in the compiled loop, which reads the same declaration."""
    monkeypatch.setenv("H2O_STREAM_COMPILED", compiled)
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(80)
    runs = []
    for policy in (make_policy("h2o", 12), HeaviestPolicy(heavy=6, recent=6)):
        cache = StreamingCache(model, policy)
        logits = torch.cat([model(ids[:, i : i + chunk], cache=cache).logits for i in range(0, 80, chunk)], dim=1)
        runs.append((logits, [layer.positions for layer in cache.layers], cache.evicted))
    (h2o, h2o_kept, evicted), (new, new_kept, new_evicted) = runs
    assert evicted > 0 and new_evicted == evicted
    assert torch.equal(new, h2o) and all(torch.equal(a, b) for a, b in zip(new_kept, h2o_kept, strict=True))


def test_h2o_adds_a2sf_forgets_and_tova_replaces_the_attention_received():
    scores = torch.tensor([[[1.0, 2.0]]])
    make_policy("h2o", 16).update_scores(scores, torch.tensor([[[0.5, 0.25]]]))
    assert scores.tolist() == [[[1.5, 2.25]]]
    make_policy("a2sf", 16, alpha=0.5).update_scores(scores, torch.tensor([[[1.0, 0.0]]]))
    assert scores.tolist() == [[[1.75, 1.125]]]
    make_policy("tova", 16).update_scores(scores, torch.tensor([[[0.25, 0.75]]]))
    assert scores.tolist() == [[[0.25, 0.75]]]


def test_bad_declarations_are_refused():
    with pytest.raises(H2OStreamError, match="tuple of Part"):
        type("Bad", (EvictionPolicy,), {"name": "bad", "parts": ("heavy",), "keep": lambda *a: None})
    with pytest.raises(H2OStreamError, match="at most one rest part"):
        register(
            type(
                "TwoRests",
                (EvictionPolicy,),
                {"name": "two-rests", "parts": (Part("a", "a"), Part("b", "b")), "keep": lambda *a: None},
            )
        )
    with pytest.raises(H2OStreamError, match="taken by"):
        register(type("Impostor", (EvictionPolicy,), {"name": "h2o", "keep": lambda *a: None}))
    with pytest.raises(H2OStreamError, match="name usable as an argument"):
        Part("two words", "x")
    with pytest.raises(H2OStreamError, match="moments .* need per-KV-head scores"):
        Scores("moments", heads="layer")
    with pytest.raises(H2OStreamError, match="scores accumulate by one of sum, decay, latest, moments"):
        Scores("max")
    with pytest.raises(H2OStreamError, match="ranks by score and needs a scoring"):
        type("RankedByNothing", (EvictionPolicy,), {"name": "ranked-by-nothing", "ranking": "score"})
    with pytest.raises(H2OStreamError, match=r"ranks by the mean and needs Scores\('moments'\)"):
        type("MeanOfSums", (EvictionPolicy,), {"name": "mean-of-sums", "ranking": "mean", "scoring": Scores()})
    with pytest.raises(H2OStreamError, match="ranking must be one of age, score, mean"):
        type("Alphabetical", (EvictionPolicy,), {"name": "alphabetical", "ranking": "alphabetical"})
    with pytest.raises(H2OStreamError, match="scoring must be a Scores declaration"):
        type("SumString", (EvictionPolicy,), {"name": "sum-string", "scoring": "sum"})
    assert POLICIES["h2o"] is H2OPolicy and "two-rests" not in POLICIES


def test_a_declaration_missing_what_the_engine_will_read_is_refused_when_defined():
    # ranking None promises a `keep` of its own: without one, the first cut was a KeyError (RANKERS[None])
    with pytest.raises(H2OStreamError, match="ranks nothing .* needs a `keep` of its own"):
        type("Unranked", (EvictionPolicy,), {"name": "unranked", "parts": (RECENT,), "ranking": None})
    # a pyramid schedule reads the setting `beta`: without it, making a cache was an AttributeError
    with pytest.raises(H2OStreamError, match="pyramid schedule and needs the settings beta"):
        type(
            "Betaless",
            (EvictionPolicy,),
            {
                "name": "betaless",
                "parts": (HEAVY, RECENT),
                "scoring": Scores(),
                "ranking": "score",
                "layer_schedule": "pyramid",
            },
        )


# -- bad input, through make_policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0, -0.5, 1.5, 1.0000001, math.nan, math.inf, "0.5", True])
def test_a_forgetting_factor_outside_zero_one_is_refused(alpha):
    with pytest.raises(H2OStreamError, match=r"alpha \(the a2sf forgetting factor\) must be a number in \(0, 1\]"):
        make_policy("a2sf", 16, alpha=alpha)


@pytest.mark.parametrize("alpha", [1, 1.0, 0.5, 1e-9])
def test_a_forgetting_factor_in_zero_one_is_taken(alpha):
    assert make_policy("a2sf", 16, alpha=alpha).alpha == float(alpha)
    assert make_policy("a2sf", 16).alpha == 0.95  # the declared default


@pytest.mark.parametrize(
    "name, parts, message",
    [
        (
            "keydiff",
            dict(sinks=4, diverse=4, recent=4),
            "keydiff(sinks=4, diverse=4, recent=4) adds up to 12, not the cache size 16",
        ),
        ("tova", dict(states=10), "adds up to 10, not the cache size 16"),
        ("h2o_sinks", dict(sinks=8, heavy=10), "sinks=8 + heavy=10 exceeds the cache size (16)"),
        ("a2sf", dict(heavy=17), "heavy (17) cannot exceed the cache size (16)"),
    ],
)
def test_parts_that_do_not_add_up_are_refused(name, parts, message):
    with pytest.raises(H2OStreamError, match=re.escape(message)):
        make_policy(name, 16, **parts)


@pytest.mark.parametrize(
    "name, given, message",
    [
        ("tova", dict(recent=4), "the tova policy takes states, per_head; it does not take recent"),
        ("h2o", dict(alpha=0.5), "the h2o policy takes heavy, recent; it does not take alpha"),
        ("sink", dict(per_head=False), "the sink policy takes sinks, recent; it does not take per_head"),
        ("keydiff", dict(separators=2), "the keydiff policy takes sinks, diverse, recent; it does not take separators"),
        ("a2sf", dict(decay=0.5), "no policy takes decay"),
    ],
)
def test_a_part_or_setting_a_policy_does_not_take_is_refused(name, given, message):
    with pytest.raises(H2OStreamError, match=re.escape(message)):
        make_policy(name, 16, **given)


def test_a_policy_that_needs_a_tokenizer_given_none_is_refused():
    with pytest.raises(H2OStreamError, match="the sepllm policy needs the model's tokenizer"):
        make_policy("sepllm", 16)


def test_tova_per_head_must_be_a_flag():
    with pytest.raises(H2OStreamError, match="per_head must be true or false"):
        make_policy("tova", 16, per_head="yes")


# -- a new policy, defined here: nothing else in the package changes ------------------------------------------------


@dataclass
class OldestPolicy(EvictionPolicy):
    """Keeps the stream's first `oldest` entries and the last `recent` (sink-like, but with a part of its own, a
    shared default, and no band: the engine takes its general path)."""

    oldest: int
    recent: int
    name = "oldest"
    parts = (Part("oldest", "the stream's first entries", share=0.25), RECENT)

    def keep(self, positions: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        first = torch.arange(self.oldest, device=positions.device).expand(*positions.shape[:2], self.oldest)
        return torch.cat([first, last_slots(positions.shape[-1], self.recent, positions)], dim=-1)


@pytest.fixture
def oldest_policy():
    register(OldestPolicy)
    try:
        yield OldestPolicy
    finally:
        del POLICIES[OldestPolicy.name]


def test_make_policy_splits_a_new_policy_by_its_declaration(oldest_policy):
    assert make_policy("oldest", 16) == OldestPolicy(oldest=4, recent=12)
    assert make_policy("oldest", 16, oldest=2) == OldestPolicy(oldest=2, recent=14)
    assert make_policy("oldest", 16, recent=10).describe() == "oldest(oldest=6, recent=10)"
    assert make_policy("h2o", 256, heavy=64, recent=192).describe() == "h2o(heavy=64, recent=192)"
    with pytest.raises(H2OStreamError, match="the oldest policy takes oldest, recent; it does not take heavy"):
        make_policy("oldest", 16, heavy=3)
    with pytest.raises(H2OStreamError, match="the h2o policy takes heavy, recent; it does not take oldest"):
        make_policy("h2o", 16, oldest=3)


def test_the_library_takes_a_new_policys_parts_by_name(oldest_policy):
    model = tiny_model("llama", init_std=0.2)
    result = stream_perplexity(model, None, random_ids(100)[0], policy="oldest", cache_size=16, chunk_size=1, oldest=2)
    assert result.settings["policy"] == "oldest" and (result.settings["oldest"], result.settings["recent"]) == (2, 14)
    assert result.predicted == 99
    # Token by token its rule is sink's; it gets there through the engine's general path (no band).
    sink = stream_perplexity(model, None, random_ids(100)[0], policy="sink", cache_size=16, chunk_size=1, sinks=2)
    assert sink.nll_sum == pytest.approx(result.nll_sum, rel=1e-5)


def test_the_command_line_options_come_from_the_registry(oldest_policy):
    from h2o_stream.cli.options import cache_options

    @click.command()
    @cache_options("oldest", 32)
    def probe(policy, cache_size, parts, no_rolling):
        click.echo(json.dumps([policy, cache_size, parts, make_policy(policy, cache_size, **parts).describe()]))

    runner = CliRunner()
    text = " ".join(runner.invoke(probe, ["--help"]).output.split())
    assert "--oldest SLOTS oldest: the stream's first entries (default: 0.25 of the cache size)." in text
    takers = [name for name, cls in POLICIES.items() if RECENT in cls.parts]  # roco's recent part has its own help
    assert "oldest" in takers and f"--recent SLOTS {', '.join(takers)}: recent-window slots" in text
    assert f"Eviction policy: {', '.join(POLICIES)}." in text  # every registered policy, the new one too
    result = runner.invoke(probe, ["--oldest", "3"])
    assert json.loads(result.output) == ["oldest", 32, {"oldest": 3}, "oldest(oldest=3, recent=29)"]
    # settings that are not slot counts get options too: a value of their default's type, a flag for a bool
    assert "--alpha FLOAT a2sf: forgetting factor in (0, 1]" in text and "(default: 0.95)" in text
    assert "--per-head tova: decide per KV head" in text
    result = runner.invoke(probe, ["--policy", "a2sf", "--alpha", "0.5"])
    assert json.loads(result.output)[2] == {"alpha": 0.5} and "alpha=0.5" in json.loads(result.output)[3]
    result = runner.invoke(probe, ["--policy", "tova", "--per-head"])
    assert json.loads(result.output)[2] == {"per_head": True}
    assert json.loads(runner.invoke(probe, ["--policy", "tova"]).output)[2] == {}  # an absent flag is not given
    result = runner.invoke(probe, ["--cache-size", "big"])
    assert isinstance(result.exception, H2OStreamError) and "--cache-size must be a whole number" in str(
        result.exception
    )


@pytest.fixture
def ppl_with_oldest():
    """The ppl command as it is built when the new policy's file is part of the package (options are made from the
    registry when the command module is imported); rebuilt without it afterwards."""
    ppl_module = importlib.import_module("h2o_stream.cli.ppl")  # the module: `h2o_stream.cli.ppl` is the command
    register(OldestPolicy)
    try:
        yield importlib.reload(ppl_module).ppl
    finally:
        del POLICIES[OldestPolicy.name]
        importlib.reload(ppl_module)


def test_ppl_runs_a_new_policy_and_reports_its_split(ppl_with_oldest, ppl_model_dir, tmp_path, capsys):
    import h2o_stream

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A new policy is one small class in its own file. " * 40)
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        500,
        "--policy",
        "oldest,h2o",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--oldest",
        2,
        "--out",
        tmp_path / "out",
    ]
    ppl_with_oldest.main(args=[str(a) for a in args], standalone_mode=False)
    captured = capsys.readouterr()
    assert "== oldest-16: oldest(oldest=2, recent=14)" in captured.err
    assert "== h2o-16: h2o(heavy=8, recent=8)" in captured.err  # --oldest goes only to the policy that takes it
    result = json.loads((tmp_path / "out" / "oldest-16.json").read_text())
    assert result["settings"]["policy"] == "oldest" and result["settings"]["oldest"] == 2
    assert result["tokens_fed"] == 500 and result["versions"]["h2o_stream"] == h2o_stream.__version__
    row = next(line for line in captured.out.splitlines() if line.startswith("oldest"))
    assert row.split()[1:4] == ["oldest=2", "recent=14", "16"]


# -- the hooks ------------------------------------------------------------------------------------------------------


def test_ages_count_steps_in_the_cache():
    assert ages(torch.tensor([[[0, 1, 5, 9]]])).tolist() == [[[10, 9, 5, 1]]]


def test_the_last_query_option_scores_only_the_last_query_and_layer_mean_averages_every_query_head():
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    mask = (torch.arange(7) <= torch.arange(4, 7).unsqueeze(-1))[None, None]
    _, every = attend_with_scores(query, key, value, mask, 0.3)
    _, last = attend_with_scores(query, key, value, mask, 0.3, last_query=True)
    probs = torch.softmax(
        (query.view(1, 2, 2, 3, 8) * 0.3) @ key.unsqueeze(2).transpose(-1, -2)
        + torch.where(mask, 0.0, -math.inf).unsqueeze(2),
        dim=-1,
    )
    assert torch.allclose(every, probs.sum(dim=(2, 3)), atol=1e-6)
    assert torch.allclose(last, probs[..., -1, :].sum(dim=2), atol=1e-6)
    mean = layer_mean(last, 4)
    assert torch.allclose(mean[0, 0], probs[..., -1, :].sum(dim=(1, 2))[0] / 4) and torch.equal(mean[0, 0], mean[0, 1])


def test_a2sf_without_forgetting_and_h2o_sinks_without_sinks_are_h2o():
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(90)
    runs = {}
    for name, spec in [
        ("h2o", make_policy("h2o", 12)),
        ("a2sf", make_policy("a2sf", 12, alpha=1)),
        ("h2o_sinks", make_policy("h2o_sinks", 12, sinks=0)),
    ]:
        cache = StreamingCache(model, spec)
        logits = torch.cat([model(ids[:, i : i + 4], cache=cache).logits for i in range(0, 90, 4)], dim=1)
        runs[name] = logits, [layer.positions for layer in cache.layers]
    for name in ("a2sf", "h2o_sinks"):
        assert torch.equal(runs[name][0], runs["h2o"][0])
        assert all(torch.equal(a, b) for a, b in zip(runs[name][1], runs["h2o"][1], strict=True))


def test_tova_in_a_chunk_keeps_what_the_last_query_attends_to_most():
    """The official code's prompt handling: one cut, by the last query's attention averaged over the layer's heads."""
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    ids = random_ids(20)
    cache = StreamingCache(model, make_policy("tova", 6))
    captured = []
    original = cache.layers[0].after_attention
    cache.layers[0].after_attention = lambda received, **kwargs: (
        captured.append(received.clone()),
        original(received, **kwargs),
    )
    model(ids, cache=cache)
    kept = cache.layers[0].positions[0, 0]
    expected = torch.sort(torch.sort(captured[0][0, 0], descending=True, stable=True).indices[:6]).values
    assert kept.tolist() == expected.tolist() and torch.equal(captured[0][0, 0], captured[0][0, 1])
    assert captured[0][0, 0].sum().item() == pytest.approx(1.0)  # one query's distribution, not twenty


# -- keys and token ids for `keep` ----------------------------------------------------------------------------------


def test_separators_come_from_the_tokenizer(tokenizer):
    ids = separator_ids(tokenizer)
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    assert ids and all(all(c in SEPARATOR_PUNCTUATION or c.isspace() for c in texts[i]) for i in ids)
    for mark in [",", ".", "?", "!", ";", ":", "\n"]:  # each mark's own token is among them
        assert tokenizer.convert_tokens_to_ids(tokenizer.tokenize(mark))[0] in ids, mark
    assert not set(ids) & set(tokenizer.all_special_ids)
    words = tokenizer("plain words")["input_ids"]
    assert not set(words) & set(ids)
    policy = make_policy("sepllm", 20, tokenizer=tokenizer)
    assert (policy.sinks, policy.separators, policy.recent, policy.separator_ids) == (4, 4, 12, ids)
    assert policy.describe() == f"sepllm(sinks=4, separators=4, recent=12; {len(ids)} separator tokens)"
    assert policy.settings()["separator_ids"] == list(ids)


def test_sepllm_keeps_the_last_separators_of_real_text(tokenizer, model):
    text = "Hello, world. What is two plus two? Four! Then: more; text. " * 6
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    policy = make_policy("sepllm", 16, tokenizer=tokenizer, sinks=2, separators=6)
    cache = StreamingCache(model, policy)
    for t in range(ids.shape[1]):
        model(ids[:, t : t + 1], cache=cache)
    stream = ids[0].tolist()
    kept = cache.layers[1].positions[0, 0].tolist()
    middle_candidates = [p for p in range(2, len(stream) - 8) if stream[p] in policy.separator_ids]
    assert kept[:2] == [0, 1] and kept[-8:] == list(range(len(stream) - 8, len(stream)))
    assert kept[2:8] == middle_candidates[-6:]


def test_sepllm_refuses_embeddings_and_empty_separator_lists():
    model = tiny_model("llama")
    policy = SepLLMPolicy(sinks=1, separators=2, recent=3, separator_ids=(5, 9))
    cache = StreamingCache(model, policy)
    with pytest.raises(H2OStreamError, match="reads the token id of every entry"):
        model(inputs_embeds=model.get_input_embeddings()(random_ids(3)), cache=cache)
    assert cache.seen == 0
    with pytest.raises(H2OStreamError, match="no separator tokens"):
        SepLLMPolicy(sinks=1, separators=2, recent=3, separator_ids=())


@pytest.mark.parametrize("chunk", [1, 5], ids=["exact", "chunked"])
def test_sepllm_batches_rows_independently_and_saves_its_token_ids(chunk):
    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    # separators to spare: a fair chunk of 5 first cuts this budget of 16 to 12, keeping 6 of them
    policy = SepLLMPolicy(sinks=2, separators=9, recent=5, separator_ids=tuple(range(2, 101, 3)))
    ids = torch.cat([random_ids(60, seed=s) for s in (1, 2)])

    def run(rows, cache=None):
        cache = cache or StreamingCache(model, policy)
        return torch.cat([model(rows[:, i : i + chunk], cache=cache).logits for i in range(0, 60, chunk)], 1), cache

    batched, cache = run(ids)
    for row in range(2):
        assert torch.allclose(batched[row], run(ids[row : row + 1])[0][0], atol=1e-4, rtol=0)
    assert not torch.equal(cache.layers[0].positions[0], cache.layers[0].positions[1])
    # a saved cache carries the token ids and continues exactly
    restored = StreamingCache(model, policy)
    restored.load_state(cache.state())
    more = random_ids(5, seed=5).expand(2, 5)
    assert torch.equal(model(more, cache=restored).logits, model(more, cache=cache).logits)
    assert torch.equal(restored.layers[0].tokens, cache.layers[0].tokens)


@pytest.mark.parametrize("name", ["keydiff", "sepllm"])
def test_policies_without_scores_keep_the_fused_path_and_refuse_chunks_wider_than_the_cache(name, monkeypatch):
    import h2o_stream.engine.hooks as hooks

    model = tiny_model("llama")
    policy = (
        make_policy("keydiff", 4)
        if name == "keydiff"
        else SepLLMPolicy(sinks=1, separators=1, recent=2, separator_ids=(3,))
    )
    cache = StreamingCache(model, policy)
    calls = []
    monkeypatch.setattr(hooks, "attend_with_scores", lambda *a, **k: calls.append(1))
    model(random_ids(3), cache=cache)
    assert not calls  # plain SDPA: no explicit softmax for a policy that needs no scores
    assert cache.max_chunk == 4
    with pytest.raises(H2OStreamError, match="chunk of 5 tokens"):
        model(random_ids(5, seed=2), cache=cache)


def test_generate_with_sepllm_matches_a_manual_greedy_loop():
    model = tiny_model("llama", init_std=0.2)
    policy = SepLLMPolicy(sinks=2, separators=4, recent=10, separator_ids=tuple(range(2, 101, 3)))
    prompt = random_ids(20)
    got = model.generate(prompt, max_new_tokens=30, do_sample=False, cache=StreamingCache(model, policy))
    cache = StreamingCache(model, policy)
    tokens, logits = prompt, model(prompt, cache=cache).logits[:, -1]
    for _ in range(30):
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=-1)
        logits = model(tokens[:, -1:], cache=cache).logits[:, -1]
    assert torch.equal(got, tokens) and cache.slots == 16


def test_top_slots_one_entry_cut_equals_the_stable_sort():
    """The one-entry cut (exact mode's usual case) takes a shortcut; it must keep what the stable sort keeps, ties
    going to the older entry, on tie-heavy ranks."""

    def by_sort(ranks, count):
        order = torch.sort(ranks, dim=-1, descending=True, stable=True).indices
        return order[..., :count].sort(dim=-1).values

    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        m = int(torch.randint(2, 40, (1,), generator=generator))
        ranks = torch.randint(0, 4, (2, 3, m), generator=generator).double()
        assert torch.equal(top_slots(ranks, m - 1), by_sort(ranks, m - 1))
        assert torch.equal(top_slots(ranks, m - 1, start=5), by_sort(ranks, m - 1) + 5)
        assert torch.equal(top_slots(ranks, m // 2), by_sort(ranks, m // 2))


def test_keep_top_is_sinks_then_the_top_ranks_then_the_recent_window():
    """keep_top's one-entry cut returns every slot but one in a single range; it must equal the three parts
    assembled, ties going to the older entry, with and without sinks, at any cut."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(300):
        sinks, recent = (int(v) for v in torch.randint(0, 5, (2,), generator=generator))
        m = int(torch.randint(2, 30, (1,), generator=generator))
        ranks = torch.randint(0, 4, (2, 3, m), generator=generator).double()
        n = sinks + m + recent
        for count in (m - 1, m // 2):
            expected = torch.cat(
                [
                    torch.arange(sinks).expand(2, 3, sinks),
                    top_slots(ranks, count, start=sinks),
                    torch.arange(n - recent, n).expand(2, 3, recent),
                ],
                dim=-1,
            )
            assert torch.equal(keep_top(ranks, count, sinks=sinks, recent=recent), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.long])
def test_keep_top_keeps_the_same_slots_compiled_as_on_tensors(dtype, monkeypatch):
    """A cut dropping few is compiled on the CPU (engine/compiled_cuts.py): the same slots as the two stable sorts,
    with many ties, infinities and NaN (above every number, as torch sorts it), for every count it takes and one
    beyond."""
    from h2o_stream.engine.compiled_cuts import FEW

    generator = torch.Generator().manual_seed(2)
    special = [float("nan"), float("inf"), -float("inf")] if dtype.is_floating_point else [-(2**62), 2**62]
    for _ in range(60):
        sinks, recent = (int(v) for v in torch.randint(0, 4, (2,), generator=generator))
        m = int(torch.randint(2, 90, (1,), generator=generator))
        ranks = torch.randint(0, 5, (2, 3, m), generator=generator).to(dtype)
        odd = torch.rand(2, 3, m, generator=generator) < 0.1
        ranks[odd] = torch.tensor(special, dtype=dtype)[torch.randint(0, len(special), (int(odd.sum()),))]
        for count in {1, m // 2, m - 2, m - FEW, m - FEW - 1} - {m - 1}:
            if count < 1:
                continue
            compiled = keep_top(ranks, count, sinks=sinks, recent=recent)
            with monkeypatch.context() as patch:
                patch.setenv("H2O_STREAM_COMPILED", "0")
                on_tensors = keep_top(ranks, count, sinks=sinks, recent=recent)
            assert torch.equal(compiled, on_tensors), (m, count)


def test_keep_top_keeps_half_precision_ranks_on_tensors():
    """Ranks numpy cannot read (bfloat16) take the two sorts: the same slots as the same ranks in float32."""
    ranks = torch.randint(0, 4, (1, 2, 30), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    kept = keep_top(ranks, 26, sinks=2, recent=3)
    assert torch.equal(kept, keep_top(ranks.float(), 26, sinks=2, recent=3))
