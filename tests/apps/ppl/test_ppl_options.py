"""ppl's options: one clear line for bad values, no option silently ignored, every run validated before the first
one starts, and an offline Hub failing in seconds (models and the Hub corpus)."""

from __future__ import annotations

import socket
import time

import pytest

from support.ppl_helpers import ppl, ppl_error, snapshot, write_corpus


@pytest.fixture
def base(ppl_model_dir, tmp_path):
    return [
        "--model",
        ppl_model_dir,
        "--data",
        write_corpus(tmp_path / "corpus.jsonl"),
        "--tokens",
        300,
        "--chunk-size",
        8,
        "--out",
        tmp_path / "out",
    ]


def test_cache_size_says_integers(base, capsys):
    assert "--cache-size must be a comma-separated list of integers, got 'abc'" in ppl_error(
        capsys, *base, "--cache-size", "abc"
    )


@pytest.mark.parametrize("policies, part", [("h2o", "--sinks"), ("sink,window", "--heavy"), ("full", "--recent")])
def test_a_budget_part_no_policy_takes_is_refused(base, capsys, policies, part):
    message = ppl_error(capsys, *base, "--policy", policies, part, 4)
    assert f"{part} does not apply to {policies.replace(',', ', ')}" in message


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--policy", "sink", "--cache-size", "16,100000"],
            "cache size 100000 does not fit the model's context of 1024",
        ),
        (["--policy", "h2o", "--cache-size", "16,4"], "a chunk of 8 tokens over a cache of 4"),
        (["--policy", "sink,full", "--cache-size", "16", "--no-rolling", "--tokens", 1025], "1024 tokens fit in all"),
    ],
)
def test_every_run_is_validated_before_the_first_one_starts(base, tmp_path, capsys, args, message):
    assert message in ppl_error(capsys, *base, *args)
    out = tmp_path / "out"
    assert not list(out.glob("*.json")) and not list(out.glob("*.ckpt")), "the first run ran before the check"


@pytest.fixture
def no_network(monkeypatch):
    """No name resolves, as on a machine without network (huggingface_hub would retry for a minute), and no proxy
    (behind one the download is left to try). Offline mode is off: conftest removes the user's HF_HUB_OFFLINE."""

    def unresolvable(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_an_unreachable_hub_fails_fast_for_a_model(base, capsys, no_network):
    started = time.monotonic()
    args = [a if a != base[1] else "h2o-stream-tests/no-such-model" for a in base]
    message = ppl_error(capsys, *args)
    assert "huggingface.co cannot be reached" in message and "not in the local Hugging Face cache" in message
    assert time.monotonic() - started < 15  # retrying took about a minute


def test_an_unreachable_hub_fails_fast_for_the_corpus(base, tmp_path, capsys, no_network):
    started = time.monotonic()
    message = ppl_error(capsys, "--model", base[1], "--tokens", 300, "--out", tmp_path / "out")
    assert "could not load PG-19 from the Hugging Face Hub (huggingface.co cannot be reached" in message
    assert time.monotonic() - started < 15


def test_offline_mode_goes_to_the_local_cache_only(base, capsys, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [a if a != base[1] else "h2o-stream-tests/no-such-model" for a in base]
    assert "offline mode is on: HF_HUB_OFFLINE is set" in ppl_error(capsys, *args)


@pytest.mark.parametrize(
    "args, says",
    [
        (["--policy", "full", "--tokens", 1025], "use --tokens 1024 or fewer, or --reset-per-book with --book-tokens"),
        (["--policy", "sink,full", "--cache-size", 16, "--tokens", 1025], "--policy full keeps every token"),
        (["--policy", "full", "--tokens", 1025, "--skip-tokens", 4000], "use --tokens 1024 or fewer"),
        (["--policy", "full", "--tokens", 1025, "--book-tokens", 2000], "use --tokens 1024 or fewer"),
        (["--policy", "full", "--tokens", 3000, "--reset-per-book"], "use --book-tokens 1024 or fewer"),
        (
            ["--policy", "full", "--tokens", 3000, "--reset-per-book", "--book-tokens", 1100],
            "book 0 has more than 1,024 tokens",
        ),
    ],
)
def test_full_whose_cache_outgrows_the_models_positions_is_refused_before_any_run(base, capsys, args, says):
    """full keeps every token, so its positions grow with the stream (or, with --reset-per-book, with each book):
    a stream or book longer than the model's 1,024 positions is refused up front, naming what to change."""
    code, _, stderr = ppl(capsys, *base, *args)
    assert code == 2 and stderr.strip().splitlines()[-1].startswith("Error: "), stderr
    assert says in stderr.strip().splitlines()[-1] and "Traceback" not in stderr
    assert "== " not in stderr, "a run started before the check"


@pytest.mark.parametrize(
    "args",
    [
        ["--tokens", 1024],
        ["--tokens", 2000, "--reset-per-book", "--book-tokens", 1000],
    ],
    ids=["the-whole-stream-fits", "each-book-fits"],
)
def test_full_within_the_models_positions_runs(base, capsys, args):
    code, _, stderr = ppl(capsys, *base, "--policy", "full", "--chunk-size", 64, *args)
    assert code == 0, stderr


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--cache-size", 64, "--span", 7], {}, "--span 7 is not a multiple of the chunk size of h2o-64 (4)"),
        (["--model", "some-org/unknown-model"], {"HF_HUB_OFFLINE": "1"}, "offline mode is on"),
        (["--device", "cuda:99"], {}, "device 'cuda:99'"),
        (["--dtype", "float64"], {}, "unknown --dtype 'float64'"),
    ],
    ids=["span", "offline-model", "device", "dtype"],
)
def test_a_refused_run_leaves_no_out_folder_behind(ppl_model_dir, tmp_path, capsys, monkeypatch, args, env, says):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "new" / "out"
    base = ["--model", ppl_model_dir, "--data", write_corpus(tmp_path / "corpus.jsonl"), "--tokens", 300]
    message = ppl_error(capsys, *base, "--policy", "h2o", "--cache-size", 16, "--out", out, *args)
    assert says in message
    assert not (tmp_path / "new").exists(), "the refused run left its --out behind"


def test_a_refused_run_keeps_an_existing_out_folder_as_it_was(ppl_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["--model", "some-org/unknown-model", "--data", write_corpus(tmp_path / "corpus.jsonl"), "--out", out]
    assert "offline mode is on" in ppl_error(capsys, *args, "--tokens", 300)
    assert snapshot(out) == {"notes.txt": b"mine"} and [p.name for p in out.iterdir()] == ["notes.txt"]
