"""What a hostile or an ordinary client meets at the edges of `h2o-stream serve`: numbers at the ends of their range,
bodies nested deep or carrying NaN, per-request cache settings the operator did not allow, turns that would read
more than the operator allows or pass the model's context (refused before anything is read), system messages in
the middle of a history, `GET /v1/models/{id}`, legacy text completions, and a graceful stop during a stream."""

from __future__ import annotations

import signal
import threading

import openai
import pytest
import torch

from h2o_stream.apps.serve import Limits
from support.serve_helpers import (
    CACHE,
    GREEDY,
    MODEL,
    conversation,
    extra,
    raw,
    reference,
    reply_of,
    serve_process,
    served,
    streamed,
)

PROMPT_LIMIT = 150  # tokens one turn may read here (a first turn reads the template's default system prompt too)
TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.", "user assistant system"]


@pytest.fixture(scope="module")
def server(model, tokenizer, tmp_path_factory):
    with served(
        model, tokenizer, tmp_path_factory.mktemp("state"), limits=Limits(max_prompt_tokens=PROMPT_LIMIT)
    ) as running:
        yield running


def test_a_seed_anywhere_in_64_bits_is_taken_and_beyond_is_a_400(server):
    client = server.client()
    replies = [
        reply_of(
            client.chat.completions.create(
                model=MODEL, messages=conversation([], "hello"), temperature=1.0, max_tokens=4, seed=seed
            )
        )
        for seed in (2**63, 2**64 - 1, 2**63)
    ]
    assert replies[0] == replies[2]
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.chat.completions.create(model=MODEL, messages=conversation([], "hello"), seed=2**64)


@pytest.mark.parametrize(
    "body, says",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 40 + b"]" * 40 + b"}]}",
            "nested",
        ),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}',
            "Infinity",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e300}',
            "repetition_penalty",
        ),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_k": 99999999999999999999}', "top_k"),
    ],
)
def test_deep_bodies_and_numbers_out_of_range_are_400s(server, body, says):
    code, answer = raw(f"{server.url}/chat/completions", body)
    assert code == 400 and says in answer["error"]["message"]
    assert server.client().chat.completions.create(model=MODEL, messages=conversation([], "hi"), **GREEDY).choices


def test_a_request_cannot_choose_the_cache_unless_the_operator_allows_it(model, tokenizer, tmp_path, server):
    for field in ({"policy": "full"}, {"cache_size": 10_000}):
        with pytest.raises(openai.BadRequestError) as refused:
            server.client().chat.completions.create(
                model=MODEL, messages=conversation([], "hi"), extra_body=field, **GREEDY
            )
        assert refused.value.body["code"] == "setting_not_allowed"
        assert refused.value.body["param"] == next(iter(field))
    with served(model, tokenizer, tmp_path, allow_request_settings=True) as running:
        response = running.client().chat.completions.create(
            model=MODEL, messages=conversation([], "hi"), extra_body={"policy": "sink", "cache_size": 16}, **GREEDY
        )
        assert extra(response)["policy"].startswith("sink(") and extra(response)["cache_budget"] == 16


def test_a_turn_over_the_prompt_limit_is_refused_before_anything_is_read(server):
    client = server.client()
    records = dict(server.store.records)
    with pytest.raises(openai.BadRequestError) as long_message:
        client.chat.completions.create(model=MODEL, messages=conversation([], "hello world " * 80), **GREEDY)
    assert long_message.value.body["code"] == "prompt_too_long" and f"{PROMPT_LIMIT}" in long_message.value.message
    # a history the server does not hold is read whole: over the limit too, though its new message is short
    unheld = [(f"question {i} hello", f"answer {i} world") for i in range(12)]
    with pytest.raises(openai.BadRequestError, match="prompt_too_long|reads per request"):
        client.chat.completions.create(model=MODEL, messages=conversation(unheld, "hi"), **GREEDY)
    assert server.store.records == records  # nothing started, nothing saved
    # a conversation the server holds grows past the limit: only each new message is read
    turns: list[tuple[str, str]] = []
    for i in range(8):
        response = client.chat.completions.create(model=MODEL, messages=conversation(turns, f"hello {i}"), **GREEDY)
        turns.append((f"hello {i}", reply_of(response)))
    assert extra(response)["how"] == "continued" and extra(response)["tokens_seen"] > PROMPT_LIMIT


def test_a_turn_past_the_context_of_an_unbounded_cache_is_refused_at_once(model, tokenizer, tmp_path):
    context = model.config.max_position_embeddings
    with served(model, tokenizer, tmp_path, policy="full", cache_size=None) as running:
        client = running.client()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=conversation([], "hi"), max_tokens=context)
        assert refused.value.body["code"] == "context_length_exceeded"
        assert f"{context:,}" in refused.value.message and "max_tokens" in refused.value.message
        assert not running.store.records
        assert client.chat.completions.create(model=MODEL, messages=conversation([], "hi"), **GREEDY).choices
    with served(model, tokenizer, tmp_path / "bounded") as running:  # a bounded, rolling cache has no such limit
        response = running.client().chat.completions.create(
            model=MODEL, messages=conversation([], "hi"), max_tokens=context, temperature=0
        )
        assert response.usage.completion_tokens <= context


def test_system_messages_anywhere_are_folded_and_a_history_keeps_matching(server, model, tokenizer):
    client = server.client()
    first = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "system", "content": "answer in english"},  # after the user message it belongs to
    ]
    response = client.chat.completions.create(model=MODEL, messages=first, **GREEDY)
    ref = reference(model, tokenizer, system="be brief")
    assert reply_of(response) == ref.chat("hello\n\nanswer in english").text
    second = [
        *first,
        {"role": "assistant", "content": reply_of(response)},
        {"role": "developer", "content": "now count"},  # before the next user message
        {"role": "user", "content": "two plus two"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=second, **GREEDY)
    assert extra(again)["how"] == "continued" and extra(again)["reused_turns"] == 1
    assert reply_of(again) == ref.chat("now count\n\ntwo plus two").text


def test_models_retrieve_names_the_served_model_only(server):
    client = server.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-4o")
    assert unknown.value.body["code"] == "model_not_found"


def _continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """What the model's own greedy generate says after `prompt` (the cache never fills here, so a bounded one
    holds all of it)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert ids.shape[1] + max_new_tokens < CACHE
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_text_completions_continue_the_prompt_streamed_or_not(server, model, tokenizer):
    client = server.client()
    prompt = "two plus two is"
    expected = _continuation(model, tokenizer, prompt, 6)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == expected
    assert whole.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert whole.usage.completion_tokens <= 6 and whole.choices[0].finish_reason in ("stop", "length")
    pieces = list(client.completions.create(model=MODEL, prompt=[prompt], max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == expected
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + expected
    assert not server.service.worker.conversations.busy  # nothing kept


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"prompt": ["a", "b"]}, "one text"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
        ({"prompt": "hi", "logprobs": 2}, "logprobs"),
        ({"prompt": "hello world " * 80}, "reads per request"),
    ],
)
def test_text_completions_refuse_what_they_cannot_honour(server, fields, says):
    with pytest.raises(openai.BadRequestError, match=says):
        server.client().completions.create(model=MODEL, max_tokens=2, **fields)


def test_a_graceful_stop_ends_a_stream_with_an_error_event(model_dir, tmp_path):
    process, url = serve_process(model_dir, tmp_path)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        first = client.chat.completions.create(model=MODEL, messages=conversation([], "hello"), **GREEDY)
        turns = [("hello", reply_of(first))]
        stream = client.chat.completions.create(
            model=MODEL, messages=conversation(turns, "go on"), temperature=0, max_tokens=4000, stream=True
        )
        chunks = iter(stream)
        next(chunks)  # the reply is under way
        threading.Timer(0.2, process.send_signal, args=(signal.SIGTERM,)).start()
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    index = next((tmp_path / "conversations").glob("*.json"))
    assert '"turns": 1' in index.read_text()  # the conversation stays at its last completed turn, on disk


def test_streamed_and_whole_chat_replies_still_agree(server):
    """The responder both kinds share writes the chat format as before."""
    client = server.client()
    whole = client.chat.completions.create(model=MODEL, messages=conversation([], "hello there"), **GREEDY)
    text, info, _ = streamed(
        client.chat.completions.create(model=MODEL, messages=conversation([], "hello there"), stream=True, **GREEDY)
    )
    assert text == reply_of(whole) and info["policy"] == extra(whole)["policy"]
