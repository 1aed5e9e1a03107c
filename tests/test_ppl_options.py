"""ppl's options: one clear line for bad values, no option silently ignored, every run validated before the first
one starts, and an offline Hub failing in seconds (models and the Hub corpus)."""

from __future__ import annotations

import socket
import time

import pytest

from ppl_helpers import ppl_error, write_corpus


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
