"""The OpenAI API of `h2o-stream serve` as the official openai client sees it: models, completions streamed and
not, sampling fields, stop texts and max_tokens, the API key, bad requests (4xx, and the server goes on), clients
that go away mid-stream, and conversations served side by side."""

from __future__ import annotations

import io
import threading

import openai
import pytest

from h2o_stream.apps.serve import Limits
from support.serve_helpers import GREEDY, MODEL, conversation, extra, raw, reference, reply_of, served, streamed

TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.", "user assistant system"]


@pytest.fixture(scope="module")
def server(model, tokenizer, tmp_path_factory):
    with served(
        model,
        tokenizer,
        tmp_path_factory.mktemp("state"),
        limits=Limits(max_tokens=4096, max_messages=50),
        allow_request_settings=True,
    ) as running:
        yield running


def test_models_lists_the_one_model_served(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]


def test_completions_streamed_and_not_give_the_same_reply(server, model, tokenizer):
    client = server.client()
    messages = conversation([], "hello world")
    response = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert response.object == "chat.completion" and response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason in ("stop", "length")
    assert response.usage.completion_tokens <= GREEDY["max_tokens"]
    assert reply_of(response) == reference(model, tokenizer).chat("hello world").text
    # the same request again (a new conversation, as nothing held matches): a stream of chunks
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply_of(response)


@pytest.mark.parametrize("policy", ["knorm", "random"])
def test_a_conversation_can_start_with_a_policy_of_one_score(server, policy):
    """knorm and random are one score() each: the server runs them like any declared policy."""
    response = server.client().chat.completions.create(
        model=MODEL,
        messages=conversation([], f"hello world with {policy}"),
        extra_body={"policy": policy, "cache_size": 16},
        **GREEDY,
    )
    info = extra(response)
    assert reply_of(response) and info["policy"].startswith(f"{policy}(") and info["cache_budget"] == 16


def test_max_tokens_stop_texts_and_sampling_fields_are_honoured(server):
    client = server.client()
    response = client.chat.completions.create(
        model=MODEL, messages=conversation([], "two plus two"), temperature=0, max_tokens=5
    )
    assert response.usage.completion_tokens == 5 and response.choices[0].finish_reason == "length"
    text = reply_of(response)
    cut = text[2:4] if len(text.strip()) >= 4 else None
    if cut and cut.strip():  # a stop text taken from the greedy reply itself: the reply ends before it
        stopped = client.chat.completions.create(
            model=MODEL, messages=conversation([], "two plus two"), temperature=0, max_tokens=20, stop=[cut]
        )
        assert reply_of(stopped) == text[: text.index(cut)] and stopped.choices[0].finish_reason == "stop"
    sampled = [
        reply_of(
            client.chat.completions.create(
                model=MODEL,
                messages=conversation([], "hello"),
                temperature=1.0,
                top_p=0.9,
                seed=7,
                max_tokens=6,
                extra_body={"top_k": 20, "repetition_penalty": 1.2},
            )
        )
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # a seed makes a sampled reply repeatable


def test_an_api_key_is_required_when_set(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path, api_keys=("s3cret",)) as running:
        for key in ("wrong", "none"):
            with pytest.raises(openai.AuthenticationError) as refused:
                running.client(api_key=key).models.list()
            assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                running.client(api_key=key).chat.completions.create(model=MODEL, messages=conversation([], "hi"))
        assert raw(f"{running.url}/models")[0] == 401  # no header at all
        good = running.client(api_key="s3cret")
        assert [m.id for m in good.models.list()] == [MODEL]
        assert good.chat.completions.create(model=MODEL, messages=conversation([], "hi"), **GREEDY).choices


BAD_BODIES = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "tiny"}', 400, "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', 400, "messages.0.content"),
    (b'{"model": "tiny", "messages": [{"role": "assistant", "content": "hi"}]}', 400, "role 'assistant'"),
    (
        b'{"model": "tiny", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
        400,
        "in turn",
    ),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "  "}]}', 400, "empty"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n must be 1"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400, "temperature"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "policy": "nope"}', 400, "policy"),
]


@pytest.mark.parametrize("body, status, says", BAD_BODIES)
def test_bad_requests_get_openai_errors_and_the_server_goes_on(server, body, status, says):
    code, answer = raw(f"{server.url}/chat/completions", body)
    assert code == status
    error = answer["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    assert server.client().chat.completions.create(model=MODEL, messages=conversation([], "hi"), **GREEDY).choices


def test_bad_fields_through_the_client_are_4xx_and_the_server_goes_on(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=conversation([], "hi"))
    assert unknown.value.body["code"] == "model_not_found"
    for max_tokens in (-1, 0, 10**9):
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model=MODEL, messages=conversation([], "hi"), max_tokens=max_tokens)
    with pytest.raises(openai.APIStatusError) as large:
        client.chat.completions.create(model=MODEL, messages=conversation([], "x" * (10 * 2**20)))
    assert large.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="too many messages"):
        client.chat.completions.create(model=MODEL, messages=conversation([("q", "a")] * 30, "hi"))
    with pytest.raises(openai.BadRequestError, match="X-Conversation-Id"):
        client.chat.completions.create(
            model=MODEL, messages=conversation([], "hi"), extra_headers={"X-Conversation-Id": "no spaces allowed"}
        )
    assert raw(f"{server.url}/nowhere")[1]["error"]["message"].startswith("no such route")
    assert client.chat.completions.create(model=MODEL, messages=conversation([], "hi"), **GREEDY).choices


def test_a_client_gone_mid_stream_stops_the_turn_and_the_conversation_stays_whole(server):
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=conversation([], "hello"), **GREEDY)
    turns = [("hello", reply_of(first))]
    conversation_id = extra(first)["conversation"]
    record = server.store.records[conversation_id]
    stream = client.chat.completions.create(
        model=MODEL, messages=conversation(turns, "tell me more"), temperature=0, max_tokens=4000, stream=True
    )
    next(iter(stream))
    stream.close()  # the client goes away after the first chunk of a long reply
    worker = server.service.worker
    for _ in range(200):  # the worker notices at its next step; wait until it has let the turn go
        if conversation_id not in worker.conversations.busy:
            break
        threading.Event().wait(0.05)
    assert conversation_id not in worker.conversations.busy
    assert server.store.records[conversation_id] is record  # nothing was committed
    again = client.chat.completions.create(model=MODEL, messages=conversation(turns, "tell me more"), **GREEDY)
    info = extra(again)
    assert info["conversation"] == conversation_id and info["how"] == "continued" and info["reused_turns"] == 1


def test_conversations_stream_side_by_side(server, model, tokenizer):
    results = {}

    def talk(k):
        messages = conversation([], f"hello {k}", system=f"helper {k}")
        results[k] = streamed(
            server.client().chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
        )[0]

    threads = [threading.Thread(target=talk, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {k: reference(model, tokenizer, system=f"helper {k}").chat(f"hello {k}").text for k in range(4)}


def test_requests_beyond_the_queue_get_429_and_the_server_goes_on(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path, max_queue=1) as running:
        client = running.client()
        long = client.chat.completions.create(
            model=MODEL, messages=conversation([], "hello"), temperature=0, max_tokens=4000, stream=True
        )
        next(iter(long))  # under way, and the only request the queue takes
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model=MODEL, messages=conversation([], "hi"), **GREEDY)
        assert refused.value.body["code"] == "server_busy"
        long.close()
        for _ in range(200):  # the worker lets the cancelled turn go at its next step
            try:
                assert client.chat.completions.create(model=MODEL, messages=conversation([], "hi"), **GREEDY).choices
                break
            except openai.RateLimitError:
                threading.Event().wait(0.05)
        else:
            pytest.fail("the server stayed busy")


def test_the_chat_repl_talks_to_a_running_server(server, model, tokenizer, monkeypatch, capsys):
    from h2o_stream.cli import main

    monkeypatch.setenv("H2O_STREAM_CHAT_HISTORY", "")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\n/stats\ntwo plus two\n/save x.session\n"))
    with pytest.raises(SystemExit) as done:
        main(["chat", "--server", server.url, "--temperature", "0", "--max-new-tokens", "4", "--system", "repl helper"])
    out, err = capsys.readouterr()
    ref = reference(model, tokenizer, system="repl helper")
    replies = [ref.chat("hello world").text, ref.chat("two plus two").text]
    assert out.startswith(replies[0] + "\n") and replies[1] + "\n" in out
    assert "turns:           1" in out and "/save is not available with --server" in err
    assert done.value.code == 1  # the refused /save
    assert any(r.turns == 2 for r in server.store.records.values())
    with pytest.raises(SystemExit) as nobody:
        main(["chat", "--server", "http://127.0.0.1:1"])
    assert nobody.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith("Error: cannot reach a server at http://127.0.0.1:1/v1")
    )
