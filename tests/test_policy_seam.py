"""The policy seam: a policy declares its budget parts, and make_policy, the command-line options, the printed split
and the result files follow the registry, so a new policy is one class (here: one defined in this test)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from policy_matrix import ALL, BANDED, EVICTING, SCORED, TOKENIZED
from tiny_models import random_ids, save_tiny_model_dir, tiny_model

import h2o_stream.engine.policies as policies_package
from h2o_stream import H2OStreamError, make_policy, register, stream_perplexity
from h2o_stream.engine.policies import POLICIES, EvictionPolicy, Part
from h2o_stream.engine.policies.base import RECENT, split_budget
from h2o_stream.engine.policies.slots import last_slots

ENGINE = Path(policies_package.__file__).resolve().parents[1]


# -- the registry and the base class -----------------------------------------------------------------------------

def test_every_module_of_the_policies_folder_is_imported_and_registers_its_policy():
    infrastructure = {"base", "registry", "slots", "split"}
    modules = {m.name for m in pkgutil.iter_modules(policies_package.__path__)} - infrastructure
    registered = {cls.__module__.rsplit(".", 1)[-1] for cls in POLICIES.values()}
    assert modules == registered
    assert {"full", "h2o", "sink", "window"} <= set(ALL)  # the matrix the other tests draw from is not empty
    assert set(SCORED) == {"h2o", "h2o_sinks", "a2sf", "tova", "roco"} and set(BANDED) == {"sink", "window"}
    assert "full" not in EVICTING and {"keydiff", "sepllm"} <= set(EVICTING) - set(SCORED) - set(BANDED)
    assert set(TOKENIZED) == {"sepllm"} and set(TOKENIZED) <= set(ALL)  # built with the tiny tokenizer, not left out


def test_every_policy_hook_the_engine_and_the_perplexity_app_use_is_declared_on_the_base_class():
    sources = [*ENGINE.glob("*.py"), *(ENGINE.parent / "apps" / "perplexity").glob("*.py")]
    used = {name for path in sources for name in re.findall(r"\bpolicy\.(\w+)", path.read_text())}
    assert {"budget", "band", "keep", "needs_scores", "describe", "settings"} <= used
    assert not {name for name in used if not hasattr(EvictionPolicy, name)}
    assert callable(EvictionPolicy.from_budget) and EvictionPolicy.parts == ()


@pytest.mark.parametrize("size, given, expected", [
    (16, {}, {"fixed": 4, "shared": 8, "rest": 4}),
    (6, {}, {"fixed": 4, "shared": 2, "rest": 0}),  # each default is capped at what is left
    (2, {}, {"fixed": 2, "shared": 0, "rest": 0}),
    (16, {"rest": 10}, {"fixed": 4, "shared": 2, "rest": 10}),  # the rest given: the last part not given is the rest
    (16, {"fixed": 1, "shared": 1}, {"fixed": 1, "shared": 1, "rest": 14}),
])
def test_a_budget_splits_by_the_declared_defaults(size, given, expected):
    parts = (Part("fixed", "f", fixed=4), Part("shared", "s", share=0.5), Part("rest", "r"))
    assert split_budget(parts, size, given) == expected


def test_parts_that_exceed_the_cache_size_are_refused():
    parts = (Part("fixed", "f", fixed=4), Part("shared", "s", share=0.5), Part("rest", "r"))
    with pytest.raises(H2OStreamError, match="exceeds the cache size"):
        split_budget(parts, 16, {"fixed": 10, "shared": 10})


def test_bad_declarations_are_refused():
    with pytest.raises(H2OStreamError, match="tuple of Part"):
        type("Bad", (EvictionPolicy,), {"name": "bad", "parts": ("heavy",), "keep": lambda *a: None})
    with pytest.raises(H2OStreamError, match="at most one rest part"):
        register(type("TwoRests", (EvictionPolicy,), {"name": "two-rests", "parts": (Part("a", "a"), Part("b", "b")),
                                                       "keep": lambda *a: None}))
    with pytest.raises(H2OStreamError, match="taken by"):
        register(type("Impostor", (EvictionPolicy,), {"name": "h2o", "keep": lambda *a: None}))
    with pytest.raises(H2OStreamError, match="name usable as an argument"):
        Part("two words", "x")
    with pytest.raises(H2OStreamError, match="score_squares needs needs_scores and per-KV-head scores"):
        register(type("SquaresOfNothing", (EvictionPolicy,), {"name": "squares-of-nothing", "score_squares": True,
                                                              "keep": lambda *a: None}))
    with pytest.raises(H2OStreamError, match="score_squares needs needs_scores and per-KV-head scores"):
        register(type("SquaresOfLayerMeans", (EvictionPolicy,), {"name": "squares-of-means", "score_squares": True,
                                                                 "needs_scores": True, "score_heads": "layer",
                                                                 "keep": lambda *a: None}))
    assert POLICIES["h2o"].__name__ == "H2OPolicy" and "two-rests" not in POLICIES
    assert not {"squares-of-nothing", "squares-of-means"} & set(POLICIES)


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
    with pytest.raises(H2OStreamError, match="no policy takes olderst"):
        make_policy("oldest", 16, olderst=3)


def test_the_library_takes_a_new_policys_parts_by_name(oldest_policy):
    model = tiny_model("llama", init_std=0.2)
    result = stream_perplexity(model, None, random_ids(100)[0], policy="oldest", cache_size=16, chunk_size=1,
                               oldest=2)
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
    assert "--recent SLOTS a2sf, h2o, h2o_sinks, keydiff, sepllm, sink, window, oldest: recent-window slots" in text
    assert "Eviction policy: a2sf, full, h2o, h2o_sinks, keydiff, roco, sepllm, sink, tova, window, oldest." in text
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
        result.exception)


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


def test_ppl_runs_a_new_policy_and_reports_its_split(ppl_with_oldest, tmp_path, capsys):
    import h2o_stream

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A new policy is one small class in its own file. " * 40)
    model_dir = save_tiny_model_dir(tmp_path / "model", init_std=0.2)
    args = ["--model", model_dir, "--data", corpus, "--tokens", 500, "--policy", "oldest,h2o", "--cache-size", 16,
            "--chunk-size", 8, "--oldest", 2, "--out", tmp_path / "out"]
    ppl_with_oldest.main(args=[str(a) for a in args], standalone_mode=False)
    captured = capsys.readouterr()
    assert "== oldest-16: oldest(oldest=2, recent=14)" in captured.err
    assert "== h2o-16: h2o(heavy=8, recent=8)" in captured.err  # --oldest goes only to the policy that takes it
    result = json.loads((tmp_path / "out" / "oldest-16.json").read_text())
    assert result["settings"]["policy"] == "oldest" and result["settings"]["oldest"] == 2
    assert result["tokens_fed"] == 500 and result["versions"]["h2o_stream"] == h2o_stream.__version__
    row = next(line for line in captured.out.splitlines() if line.startswith("oldest"))
    assert row.split()[1:4] == ["oldest=2", "recent=14", "16"]
