"""Continuous batching in `h2o-stream serve`: the forwards of the turns under way run as the rows of one batch, and
each conversation's greedy reply is the one it gets alone; with batching off, the same replies one forward at a
time."""

from __future__ import annotations

import threading

import pytest

import h2o_stream.apps.serve.batching as batching
from h2o_stream import make_policy
from h2o_stream.apps.chat import ChatSession, chat_sampling
from support.serve_helpers import CACHE, MODEL, conversation, served, streamed

TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.", "user assistant system"]
REPLY = 12


def _side_by_side(server, count: int) -> dict[int, str]:
    """`count` conversations, each started at once from its own thread and streamed: their replies."""
    results: dict[int, str] = {}

    def talk(k: int) -> None:
        messages = conversation([], f"hello {k} " * (k + 1), system=f"helper {k}")
        stream = server.client().chat.completions.create(
            model=MODEL, messages=messages, stream=True, temperature=0, max_tokens=REPLY
        )
        results[k] = streamed(stream)[0]

    threads = [threading.Thread(target=talk, args=(k,)) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def _alone(model, tokenizer, system: str, message: str) -> str:
    """The greedy reply of a chat session of the server's settings, alone in its process."""
    sampling = chat_sampling(temperature=0, max_new_tokens=REPLY, seed=0)
    session = ChatSession(model, tokenizer, policy=make_policy("h2o", CACHE), system=system, sampling=sampling)
    return session.chat(message).text


@pytest.fixture
def batch_rows(monkeypatch):
    """The number of rows of every batched forward the server runs."""
    rows: list[int] = []

    class Counted(batching.RowsCache):
        def __init__(self, model, caches):
            rows.append(len(caches))
            super().__init__(model, caches)

    monkeypatch.setattr(batching, "RowsCache", Counted)
    return rows


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "one-by-one"])
def test_each_conversation_gets_its_reply_alone_whether_batched_or_not(model, tokenizer, tmp_path, batch, batch_rows):
    with served(model, tokenizer, tmp_path, in_memory=4, batch=batch) as server:
        results = _side_by_side(server, 4)
    alone = {k: _alone(model, tokenizer, f"helper {k}", f"hello {k} " * (k + 1)) for k in range(4)}
    assert results == alone
    if batch:
        assert batch_rows and max(batch_rows) >= 2  # turns under way shared forwards
    else:
        assert not batch_rows


def test_a_text_completion_and_chat_turns_share_the_batch(model, tokenizer, tmp_path, batch_rows):
    with served(model, tokenizer, tmp_path, in_memory=4) as server:
        texts: dict[str, str] = {}

        def complete() -> None:
            answer = server.client().completions.create(model=MODEL, prompt="two plus", max_tokens=REPLY, temperature=0)
            texts["completion"] = answer.choices[0].text

        worker = threading.Thread(target=complete)
        worker.start()
        chats = _side_by_side(server, 2)
        worker.join(timeout=120)
        alone = server.client().completions.create(model=MODEL, prompt="two plus", max_tokens=REPLY, temperature=0)
    assert texts["completion"] == alone.choices[0].text and len(chats) == 2
    assert max(batch_rows) >= 2
