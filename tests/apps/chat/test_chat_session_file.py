"""The chat session file: save then load resumes exactly; bad, corrupt and foreign files are refused and change
nothing."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from h2o_stream import H2OStreamError, make_policy
from h2o_stream.apps.chat import ChatSession, Sampling, chat_format
from h2o_stream.apps.chat.session_file import SESSION_FORMAT, SESSION_VERSION
from h2o_stream.engine.feed import feed
from h2o_stream.files import MAGIC, read_verified, write_verified
from support.chat_helpers import TRAINING_TEXTS, assert_same_state, session_for, session_state, tiny_tokenizer  # noqa: F401
from support.tiny_models import tiny_llama


def test_save_then_load_gives_identical_next_token_logits_and_replies(model, tokenizer, tmp_path):
    original = session_for(model, tokenizer, temperature=1.0, seed=7, system="Be brief.")
    for text in ["hello world", "what is two plus two?", "the answer is four."]:
        original.chat(text)
    path = original.save(tmp_path / "chat.pt")
    # a new model object with the same weights, a session with other settings: load takes the saved ones
    other_model = tiny_llama(len(tokenizer))
    resumed = ChatSession(other_model, tokenizer, policy=make_policy("sink", 64), sampling=Sampling(seed=1))
    resumed.load(path)
    assert resumed.policy == original.policy and resumed.system == "Be brief." and resumed.turns == 3
    assert resumed.sampling == original.sampling and resumed.stats()["tokens_seen"] == original.stats()["tokens_seen"]
    assert resumed.recent_messages == original.recent_messages

    a, b = original.chat("once more"), resumed.chat("once more")  # sampled: the RNG state came along too
    assert a.token_ids == b.token_ids and a.text == b.text
    probe = torch.tensor([chat_format(tokenizer, "Be brief.").user_ids("and again", first=False)])
    assert torch.equal(feed(model, original.cache, probe, 4), feed(other_model, resumed.cache, probe, 4))
    assert a.token_ids == b.token_ids and a.text == b.text


def test_a_policy_that_sums_squared_attention_saves_and_resumes_exactly(model, tokenizer, tmp_path):
    """roco's scores carry a last axis (sums and sums of squares): they are saved, checked and loaded as they are."""
    original = session_for(model, tokenizer, policy="roco", size=24)
    for text in ["hello world, and a longer line to fill the cache past its budget", "and then some more"]:
        original.chat(text)
    assert original.cache.layers[0].scores.shape[-1] == 2 and original.stats()["tokens_seen"] > 24
    resumed = session_for(tiny_llama(len(tokenizer)), tokenizer, policy="sink", size=64)
    resumed.load(original.save(tmp_path / "roco.pt"))
    assert resumed.policy == original.policy
    assert original.chat("once more").token_ids == resumed.chat("once more").token_ids
    assert torch.equal(original.cache.layers[1].scores, resumed.cache.layers[1].scores)


def test_the_repetition_settings_travel_with_the_session(model, tokenizer, tmp_path):
    sampling = Sampling(temperature=0.9, top_k=40, repetition_penalty=1.3, no_repeat_ngram_size=3, seed=2)
    original = ChatSession(model, tokenizer, policy=make_policy("h2o", 32), sampling=sampling)
    original.chat("hello world")
    resumed = ChatSession(model, tokenizer, sampling=Sampling(seed=1))
    resumed.load(original.save(tmp_path / "chat.pt"))
    assert resumed.sampling == sampling
    assert resumed.chat("again").token_ids == original.chat("again").token_ids


def test_save_is_atomic_and_refuses_bad_paths(model, tokenizer, tmp_path):
    session = session_for(model, tokenizer)
    session.chat("hello")
    with pytest.raises(H2OStreamError, match="does not exist"):
        session.save(tmp_path / "missing" / "chat.pt")
    with pytest.raises(H2OStreamError, match="is a directory"):
        session.save(tmp_path)
    session.save(tmp_path / "chat.pt")
    session.save(tmp_path / "chat.pt")  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.pt"]  # no temporary files left behind


@pytest.fixture
def saved(model, tokenizer, tmp_path):
    session = session_for(model, tokenizer)
    session.chat("hello world")
    return session.save(tmp_path / "chat.pt")


def read_state(path: Path) -> dict:
    return read_verified(path, SESSION_FORMAT, SESSION_VERSION)


def resave(state: dict, path: Path, version: int = SESSION_VERSION) -> None:
    """As a session file written by a buggy or other h2o-stream would be: well-formed, with a valid checksum."""
    write_verified(path, SESSION_FORMAT, version, state)


class RunsCode:
    """Unpickling this would run a shell command (what a crafted file does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def corrupt_variants(saved: Path, tmp_path: Path, tokenizer):
    data = saved.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a session at all\n" * 10)
    flipped = bytearray(data)
    for i in range(len(flipped) // 3, len(flipped) // 3 + 64):
        flipped[i] ^= 0xFF
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    torch.save({"some": "dict"}, tmp_path / "other.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    state = read_state(saved)
    state["cache"]["layers"][0]["keys"] = state["cache"]["layers"][0]["keys"][:, :1]
    resave(state, tmp_path / "bad-shapes.pt")
    resave(read_state(saved), tmp_path / "future.pt", version=99)
    state = read_state(saved)
    del state["counters"]["turns"]
    resave(state, tmp_path / "no-counter.pt")
    state = read_state(saved)
    state["sampling"]["repetition_penalty"] = 0.5
    resave(state, tmp_path / "bad-sampling.pt")
    state = read_state(saved)
    state["cache"]["layers"][1]["scores"][0, 0, 0] += 1
    body = io.BytesIO()
    torch.save(state, body)
    header = data[: data.index(b"\n", len(MAGIC)) + 1]
    (tmp_path / "edited.pt").write_bytes(header + body.getvalue())  # edited without updating its checksum
    # a session as h2o-stream wrote it before verified files (format 1: a torch pickle with its own digest)
    torch.save(
        {"format": SESSION_FORMAT, "version": 1, **read_state(saved), "digest": "0" * 64}, tmp_path / "format-1.pt"
    )
    write_verified(tmp_path / "checkpoint.pt", "h2o-stream perplexity checkpoint", 2, {"tokens": 10})
    write_verified(
        tmp_path / "crafted.pt",
        SESSION_FORMAT,
        SESSION_VERSION,
        {**read_state(saved), "recent": RunsCode(tmp_path / "ran")},
    )  # a valid header and digest
    return {
        "missing.pt": "no session file",
        "truncated.pt": "not a readable chat session",
        "garbage.pt": "not a readable chat session",
        "flipped.pt": "not a readable chat session|damaged chat session",
        "other.pt": "not an h2o-stream chat session",
        "tensor.pt": "not an h2o-stream chat session",
        "bad-shapes.pt": "not a usable chat session",
        "future.pt": "format version 99",
        "no-counter.pt": "not a usable chat session",
        "bad-sampling.pt": "repetition_penalty",
        "edited.pt": "damaged chat session",
        ".": "is a directory",
        "format-1.pt": "saved by an older h2o-stream \\(session format 1, before verified files\\)",
        "checkpoint.pt": "not an h2o-stream chat session: it is a h2o-stream perplexity checkpoint",
        "crafted.pt": "not a readable chat session: the file holds something other than plain data",
    }


def test_load_refuses_missing_corrupt_and_foreign_files_and_leaves_the_session_alone(model, tokenizer, saved, tmp_path):
    session = session_for(model, tokenizer, policy="sink", size=16)
    session.chat("what is two plus two?")
    before = session_state(session)
    for name, message in corrupt_variants(saved, tmp_path, tokenizer).items():
        with pytest.raises(H2OStreamError, match=message):
            session.load(tmp_path / name)
        assert_same_state(session_state(session), before)
    assert not (tmp_path / "ran").exists()  # the crafted file's code never ran
    # the session still works, and a good file still loads
    session.chat("hello")
    session.load(saved)
    assert session.turns == 1 and session.policy.name == "h2o"


def test_load_refuses_another_models_session(tokenizer, saved):
    for other, message in [
        (tiny_llama(len(tokenizer), seed=1), "another model"),  # same shape, other weights
        (tiny_llama(len(tokenizer), layers=3), "another model"),
        (tiny_llama(len(tokenizer), dtype=torch.bfloat16), "--dtype float32"),
    ]:
        session = session_for(other, tokenizer)
        session.chat("hello")
        before = session_state(session)
        with pytest.raises(H2OStreamError, match=message):
            session.load(saved)
        assert_same_state(session_state(session), before)


def test_load_refuses_a_session_of_another_chat_format(model, saved):
    session = session_for(model, tiny_tokenizer(None))
    with pytest.raises(H2OStreamError, match="different chat format"):
        session.load(saved)
