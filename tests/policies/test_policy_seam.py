"""The policy seam: a policy declares its budget parts and settings, and make_policy, the command-line options, the
printed split and the result files follow the registry, so a new policy is one class (here: one defined in this
test); and the refusals, each one clear H2OStreamError. The hooks are in test_policy_hooks.py, the cut in
test_cuts.py."""

from __future__ import annotations

import dataclasses
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
from h2o_stream.engine.policies import POLICIES, EvictionPolicy, Part
from h2o_stream.engine.policies.base import HEAVY, RECENT, Scores, Setting, split_budget
from h2o_stream.engine.policies.declarations import SETTING_METADATA
from h2o_stream.engine.policies.h2o import H2OPolicy
from h2o_stream.engine.policies.ranking import MEAN, SCORE
from h2o_stream.engine.policies.slots import last_slots
from support.policy_matrix import ALL, BANDED, EVICTING, SCORED, TOKENIZED, build
from support.tiny_models import random_ids, tiny_model

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


def test_every_policys_settings_are_its_fields_declared_with_setting():
    """A setting has one declaration, its dataclass field: the options' names, order and defaults are the fields'
    (settings() and describe() list the fields in order, and checkpoints and result files compare them), and each
    option is what its field's `setting(...)` says."""
    assert any(cls.options for cls in POLICIES.values())
    for cls in POLICIES.values():
        fields = {field.name: field for field in dataclasses.fields(cls)}
        names = [name for name in fields if name in cls.option_names()]
        assert names == list(cls.option_names()), cls.name
        for option in cls.options:
            declared = fields[option.name]
            assert declared.default == option.default and type(declared.default) is type(option.default), option
            assert Setting(option.name, default=declared.default, **declared.metadata[SETTING_METADATA]) == option


def test_every_kind_of_policy_the_other_tests_draw_from_has_one():
    """The tests parametrized by tests/support/policy_matrix.py over scored, banded, and neither (keys or token ids),
    and over the policies that need a tokenizer, would pass with no case at all if a kind were empty."""
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
    ranking = SCORE


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
        type("RankedByNothing", (EvictionPolicy,), {"name": "ranked-by-nothing", "ranking": SCORE})
    with pytest.raises(H2OStreamError, match=r"ranks by the mean and needs Scores\('moments'\)"):
        type("MeanOfSums", (EvictionPolicy,), {"name": "mean-of-sums", "ranking": MEAN, "scoring": Scores()})
    with pytest.raises(H2OStreamError, match=r"ranking must be a Ranking \(policies/ranking.py"):
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
                "ranking": SCORE,
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
