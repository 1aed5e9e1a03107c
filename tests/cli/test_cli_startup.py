"""The command line answers help, --version and usage errors without loading torch, transformers, numba, matplotlib
or ray (seconds to import; eval/results/speed/startup.json measures the time), and the packages' lazily imported
names all resolve."""

from __future__ import annotations

import importlib

import pytest

from support.startup import heavy_in, imported_modules


@pytest.mark.parametrize(
    "args, status, says",
    [
        (["--help"], 0, "Commands:"),
        (["ppl", "--help"], 0, "--cache-size"),
        (["leaderboard", "--help"], 0, "--report-only"),
        (["chat", "--help"], 0, "--system"),
        (["summarize", "--help"], 0, "--strategy"),
        (["serve", "--help"], 0, "--state-dir"),
        (["--version"], 0, "version"),
        (["ppl", "--bogus"], 2, "No such option '--bogus'"),
        (["ppl", "--tokens", "many"], 2, "'many' is not a valid integer"),
        (["ppl", "--policy", "h2o,lru"], 2, "unknown policy 'lru'"),
        (["chat", "--policy", "lru"], 2, "unknown policy 'lru'"),
        (["summarize"], 2, "Missing argument 'FILE'"),
        (["no-such-command"], 2, "No such command"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_help_and_usage_errors_load_no_heavy_library(tmp_path, args, status, says):
    done, modules = imported_modules(tmp_path, *args)
    assert done.returncode == status, done.stderr[-2000:]
    assert says in done.stdout + done.stderr
    assert "h2o_stream.cli" in modules  # the measurement saw the command line load
    assert heavy_in(modules) == [], f"{' '.join(args)} imported {heavy_in(modules)[:5]}"
    assert not list(tmp_path.iterdir()), "help wrote files"


def test_a_command_still_loads_torch_when_it_runs(tmp_path):
    """The measurement can fail: a command that runs (here: refused after its model is asked for) imports torch."""
    done, modules = imported_modules(
        tmp_path,
        "ppl",
        "--model",
        str(tmp_path / "missing"),
        "--data",
        "sample",
        "--tokens",
        "10",
        "--out",
        str(tmp_path / "out"),
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "torch" in modules


def test_the_group_lists_every_command_with_its_first_paragraph_in_full(tmp_path):
    import click

    from h2o_stream.cli import COMMANDS, cli

    done, _ = imported_modules(tmp_path, "--help")
    section = done.stdout.split("Commands:")[1]
    listed = [line.split()[0] for line in section.splitlines() if line.strip() and not line.startswith(" " * 4)]
    assert listed == sorted(COMMANDS)
    assert "..." not in section
    with click.Context(cli) as context:
        for name in COMMANDS:
            first = cli.get_command(context, name).help.split("\n\n")[0]
            assert " ".join(first.split()) in " ".join(section.split()), name


@pytest.mark.parametrize(
    "package",
    [
        "h2o_stream",
        "h2o_stream.engine",
        "h2o_stream.apps.perplexity",
        "h2o_stream.apps.chat",
        "h2o_stream.apps.summarize",
    ],
)
def test_every_lazily_exported_name_resolves(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
        assert name in dir(module)
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_a_name_resolves_to_the_object_its_module_defines():
    import h2o_stream
    from h2o_stream.engine.cache import StreamingCache
    from h2o_stream.engine.policies import make_policy

    assert h2o_stream.StreamingCache is StreamingCache and h2o_stream.make_policy is make_policy
    namespace: dict = {}
    exec("from h2o_stream import *", namespace)
    assert namespace["stream_perplexity"] is h2o_stream.stream_perplexity


@pytest.mark.parametrize(
    "args, says",
    [
        (["ppl", "--tokens", "0"], "--tokens must be at least 2"),
        (["ppl", "--cache-size", "0"], "--cache-size must be at least 1, got 0"),
        (["ppl", "--cache-size", "16,0"], "--cache-size must be at least 1, got 0"),
        (["ppl", "--chunk-size", "0"], "--chunk-size must be at least 1, got 0"),
        (["ppl", "--span", "0"], "--span must be at least 1, got 0"),
        (["ppl", "--heavy", "-1"], "--heavy must be at least 0, got -1"),
        (["ppl", "--sinks", "4,-2"], "--sinks must be at least 0, got -2"),
        (["ppl", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1, got 0"),
        (["ppl", "--book-tokens", "0"], "--book-tokens must be at least 1, got 0"),
        (["ppl", "--tau-init", "0"], "--tau-init (keyformer's first temperature) must be a number in (0, "),
        (["ppl", "--merge-span", "0"], "--merge-span (cam's merge span) must be a whole number in (0, "),
        (["ppl", "--kernel", "4"], "--kernel must be an odd whole number"),
        (["ppl", "--policy", "h2o,head_hybrid"], "--retrieval-heads must be given"),
        (["ppl", "--dtype", "float64"], "unknown --dtype 'float64'"),
        (["ppl", "--device", "gpu"], "unknown --device 'gpu'"),
        (["leaderboard", "--dtype", "int8"], "unknown --dtype 'int8'"),
        (["serve", "--device", "cpu:1"], "unknown --device 'cpu:1'"),
        (["summarize", "doc.txt", "--dtype", "float64"], "unknown --dtype 'float64'"),
        (["calibrate", "--out", "heads.json", "--device", "tpu"], "unknown --device 'tpu'"),
        (["leaderboard", "--tokens", "1"], "--tokens must be at least 2"),
        (["leaderboard", "--cache-size", "128,0"], "--cache-size must be at least 1, got 0"),
        (["leaderboard", "--recent", "-1"], "--recent must be at least 0, got -1"),
        (["serve", "--cache-size", "0"], "--cache-size must be at least 1, got 0"),
        (["serve", "--heavy", "-3"], "--heavy must be at least 0, got -3"),
        (["serve", "--alpha", "1.5"], "--alpha (the a2sf forgetting factor) must be a number in (0, 1]"),
        (["summarize", "doc.txt", "--cache-size", "0"], "--cache-size must be at least 1, got 0"),
        (["summarize", "doc.txt", "--chunk-size", "0"], "--chunk-size must be at least 1, got 0"),
        (["calibrate", "--out", "heads.json", "--cache-size", "0"], "--cache-size must be at least 1, got 0"),
        (["calibrate", "--out", "heads.json", "--sinks", "-1"], "--sinks must be at least 0, got -1"),
        (["calibrate", "--out", "heads.json", "--windows", "0"], "--windows must be at least 1, got 0"),
        (["calibrate", "--out", "heads.json", "--retrieval-share", "2"], "--retrieval-share must lie in [0, 1]"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_plain_range_checks_answer_while_parsing_before_any_heavy_library_or_loading_note(tmp_path, args, says):
    done, modules = imported_modules(tmp_path, *args)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and says in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "loading " not in done.stderr
    assert heavy_in(modules) == [], f"{' '.join(args)} imported {heavy_in(modules)[:5]}"
    assert not list(tmp_path.iterdir()), "a refused command wrote files"
