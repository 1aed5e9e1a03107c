"""`h2o-stream serve` recognises conversations by their history: the official openai client against a server on
127.0.0.1, checked turn by turn against chat sessions driven directly (greedy, so replies must be equal)."""

from __future__ import annotations

from h2o_stream.apps.chat.formats import chat_format
from support.serve_helpers import CACHE, GREEDY, MODEL, conversation, extra, reference, reply_of, served, streamed

TRAINING_TEXTS = [
    "hello world, what is two plus two? the answer is four.",
    "turn number one two three",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "user assistant system",
]


def test_a_30_turn_conversation_feeds_only_its_new_tokens_and_keeps_its_cache_size(model, tokenizer, tmp_path):
    fmt = chat_format(tokenizer)
    ref = reference(model, tokenizer)
    turns: list[tuple[str, str]] = []
    seen = 0
    with served(model, tokenizer, tmp_path) as server:
        client = server.client()
        for i in range(30):
            message = f"turn {i}: what is two plus two?"
            if i % 2:  # every other turn streamed
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=conversation(turns, message),
                    stream=True,
                    stream_options={"include_usage": True},
                    **GREEDY,
                )
                text, info, usage = streamed(stream)
            else:
                response = client.chat.completions.create(model=MODEL, messages=conversation(turns, message), **GREEDY)
                text, info, usage = reply_of(response), extra(response), response.usage
            expected = ref.chat(message)
            assert text == expected.text  # the same reply as a chat session that saw the same turns
            new_tokens = len(fmt.user_ids(message, first=i == 0)) + len(fmt.closing_ids())
            assert info["fed_tokens"] == new_tokens  # only the new message (and the reply's closing) was fed
            assert usage.prompt_tokens_details.cached_tokens == seen
            assert usage.prompt_tokens == seen + new_tokens
            assert info["tokens_seen"] == seen + new_tokens + usage.completion_tokens
            assert info["how"] == ("new" if i == 0 else "continued") and info["replayed_turns"] == 0
            assert info["reused_turns"] == i and info["turns"] == i + 1
            assert info["cache_slots"] == CACHE == info["cache_budget"]  # full from the first turn, never more
            seen = info["tokens_seen"]
            turns.append((message, text))
        assert len(server.store.records) == 1
        record = next(iter(server.store.records.values()))
        assert record.turns == 30
        files = sorted(p.name for p in server.store.dir.iterdir())
        assert files == sorted([f"{record.id}.json", record.file, record.prev_file])  # two turns kept on disk


def _run(client, turns, message, **kwargs):
    response = client.chat.completions.create(model=MODEL, messages=conversation(turns, message), **GREEDY, **kwargs)
    return reply_of(response), extra(response), response


def test_edited_regenerated_and_named_histories_are_refed_from_where_they_still_match(model, tokenizer, tmp_path):
    messages = [f"question {i}: two plus two?" for i in range(6)]
    with served(model, tokenizer, tmp_path) as server:
        client = server.client()
        turns = []
        for message in messages:
            text, info, _ = _run(client, turns, message)
            turns.append((message, text))
        original = info["conversation"]

        # an earlier user message edited: nothing held matches past turn 2, so every exchange is fed again
        edited = turns[:2] + [("question 2 edited: three plus three?", turns[2][1])] + turns[3:5]
        text, info, response = _run(client, edited, messages[5])
        ref = reference(model, tokenizer)
        for user, reply in edited:
            ref.replay(user, reply)
        assert text == ref.chat(messages[5]).text
        assert info["how"] == "new" and info["reused_turns"] == 0 and info["replayed_turns"] == 5
        assert response.usage.prompt_tokens_details.cached_tokens == 0
        assert info["conversation"] != original

        # the last turn asked again (a client's "regenerate"): a branch from the turn before, nothing replayed; greedy,
        # so the same reply as the first time
        text, info, _ = _run(client, turns[:5], messages[5])
        assert text == turns[5][1]
        assert info["how"] == "branched" and info["reused_turns"] == 5 and info["replayed_turns"] == 0

        # the original history is still held whole (by the original, and by the branch, which now says the same)
        text, info, _ = _run(client, turns, "and then?")
        assert info["how"] == "continued" and info["reused_turns"] == 6 and info["replayed_turns"] == 0

        # named by id: an edit of its last turn rewinds that conversation itself
        header = {"X-Conversation-Id": "named-1"}
        named = []
        for message in messages[:3]:
            text, info, response = _run(client, named, message, extra_headers=header)
            assert response.model_extra["h2o_stream"]["conversation"] == "named-1"
            named.append((message, text))
        text, info, _ = _run(client, named[:2] + [("changed", named[2][1])], "next", extra_headers=header)
        ref = reference(model, tokenizer)
        for message in messages[:2]:
            ref.chat(message)
        ref.replay("changed", named[2][1])
        assert text == ref.chat("next").text
        assert info["conversation"] == "named-1" and info["how"] == "rewound" and info["reused_turns"] == 2
        # a history that matches nothing it held starts it again, under the same id
        text, info, _ = _run(client, [], "hello", extra_headers=header)
        assert info["how"] == "rebuilt" and info["turns"] == 1


def test_conversations_beyond_the_memory_bound_resume_from_their_files_exactly(model, tokenizer, tmp_path):
    """Three conversations taking turns with room for one in memory: every turn loads its conversation from disk,
    and the replies equal three sessions that never left memory."""
    refs = [reference(model, tokenizer, system=f"You are helper {k}.") for k in range(3)]
    histories: list[list] = [[], [], []]
    with served(model, tokenizer, tmp_path, in_memory=1) as server:
        client = server.client()
        for round_ in range(3):
            for k in range(3):
                message = f"round {round_}, hello world"
                response = client.chat.completions.create(
                    model=MODEL, messages=conversation(histories[k], message, system=f"You are helper {k}."), **GREEDY
                )
                assert reply_of(response) == refs[k].chat(message).text
                info = extra(response)
                assert info["reused_turns"] == round_ and info["replayed_turns"] == 0
                histories[k].append((message, reply_of(response)))
            assert len(server.service.worker.conversations.sessions) == 1
