"""API keys of `h2o-stream serve`: several keys (--api-key repeated, --api-keys-file, $H2O_STREAM_API_KEY), each
with conversations of its own that no other key can read, continue, replace, branch, delete or detect; and a state
directory written without keys is still served, as the keyless owner's."""

from __future__ import annotations

import json

import openai
import pytest

from h2o_stream.apps.serve import ApiError
from h2o_stream.apps.serve.keys import Keys, owner_name
from support.serve_helpers import GREEDY, MODEL, conversation, extra, on_disk, reply_of, serve_process, served

TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.", "user assistant system"]
#: the fields of a conversation's index as servers without keys wrote it (index version 1)
INDEX_FIELDS = {"kind", "version", "id", "root", "turns", "head", "file", "generation", "prev", "prev_file", "updated"}


def _talk(client, turns, message, **kwargs):
    response = client.chat.completions.create(model=MODEL, messages=conversation(turns, message), **GREEDY, **kwargs)
    return reply_of(response), extra(response)


def test_keys_are_compared_whole_and_name_their_owner():
    keys = Keys(("key-a", "key-b", "", "key-a"))
    assert keys.owner("Bearer key-b") == owner_name("key-b") != owner_name("key-a")
    assert keys.owner("bearer  key-a ") == owner_name("key-a")
    for wrong in ("Bearer key", "Bearer key-ab", "Basic key-a", "key-a", ""):
        with pytest.raises(ApiError) as refused:
            keys.owner(wrong)
        assert refused.value.status == 401 and refused.value.code == "invalid_api_key"
    assert Keys(()).owner(None) == "" and not Keys(("",))
    assert len(owner_name("key-a")) == 16 and "key-a" not in owner_name("key-a")


def test_two_keys_keep_their_conversations_apart(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path, api_keys=("key-a", "key-b")) as server:
        a, b = server.client(api_key="key-a"), server.client(api_key="key-b")
        victim = {"X-Conversation-Id": "victim"}
        turns = []
        for message in ("hello", "two plus two"):
            text, info = _talk(a, turns, message, extra_headers=victim)
            turns.append((message, text))

        # the same id from key B, with another history: a conversation of B's own, under the name B gave
        raw = b.chat.completions.with_raw_response.create(
            model=MODEL, messages=conversation([], "hi from b"), extra_headers=victim, **GREEDY
        )
        info = extra(raw.parse())
        assert raw.headers["X-Conversation-Id"] == "victim" and info["conversation"] == "victim"
        assert info["how"] == "new" and info["turns"] == 1
        # A's history sent by B: not continued, and its last turn edited: not branched from A's files
        _, copied = _talk(b, turns, "and then?")
        assert copied["how"] == "new" and copied["reused_turns"] == 0 and copied["replayed_turns"] == 2
        _, edited = _talk(b, turns[:1], "two plus two, again")
        assert edited["how"] == "new" and edited["replayed_turns"] == 1
        # ... while A itself gets both: a branch from its last turn's edit, and its named conversation back whole
        _, branched = _talk(a, turns[:1], "two plus two, again")
        assert branched["how"] == "branched" and branched["reused_turns"] == 1
        _, info = _talk(a, turns, "and then?", extra_headers=victim)
        assert info["how"] == "continued" and info["reused_turns"] == 2 and info["conversation"] == "victim"

        # B cannot delete A's conversation, nor tell it from one that never was, nor name it by its stored id
        _talk(a, [], "only a has this", extra_headers={"X-Conversation-Id": "only-a"})
        stored = f"{owner_name('key-a')}~only-a"
        for name in ("only-a", stored):
            with pytest.raises(openai.NotFoundError) as refused:
                b.conversations.delete(name)
            assert refused.value.body["message"] == f"there is no conversation {name!r}"
        with pytest.raises(openai.BadRequestError, match="X-Conversation-Id"):
            _talk(b, [], "hello", extra_headers={"X-Conversation-Id": stored})
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="key-c").conversations.delete("only-a")
        assert stored in server.store.records
        assert a.conversations.delete("only-a").deleted and stored not in server.store.records

        owners = {key.split("~")[0] for key in server.store.records}
        assert owners == {owner_name("key-a"), owner_name("key-b")}
        for path in (tmp_path / "conversations").iterdir():  # the keys themselves are never stored
            assert b"key-a" not in path.read_bytes() and b"key-b" not in path.read_bytes()


def test_a_state_dir_written_without_keys_is_served_as_the_keyless_owners(model, tokenizer, tmp_path):
    named = {"X-Conversation-Id": "old"}
    with served(model, tokenizer, tmp_path) as server:
        client = server.client()
        turns = []
        for message in ("hello", "two plus two"):
            text, info = _talk(client, turns, message, extra_headers=named)
            turns.append((message, text))
        unnamed_text, unnamed = _talk(client, [], "an unnamed one")
    index = json.loads((tmp_path / "conversations" / "old.json").read_text())
    assert set(index) == INDEX_FIELDS and index["id"] == "old" and index["file"].startswith("old.")

    with served(model, tokenizer, tmp_path) as server:  # still without keys: everything as it was
        _, info = _talk(server.client(), turns, "and then?", extra_headers=named)
        assert info["how"] == "continued" and info["reused_turns"] == 2
        _, info = _talk(server.client(), [("an unnamed one", unnamed_text)], "and then?")
        assert info["how"] == "continued" and info["conversation"] == unnamed["conversation"]
    files = {name: (tmp_path / "conversations" / name).read_bytes() for name in on_disk(tmp_path)}

    with served(model, tokenizer, tmp_path, api_keys=("key-a",)) as server:  # keys now: the old ones are no key's
        a = server.client(api_key="key-a")
        _, info = _talk(a, turns, "and then?", extra_headers=named)
        assert info["how"] == "new" and info["replayed_turns"] == 2
        _, info = _talk(a, [("an unnamed one", unnamed_text)], "and then?")
        assert info["how"] == "new" and info["conversation"] != unnamed["conversation"]
        assert a.conversations.delete("old").deleted  # A's own "old"; the keyless one stays
        assert f"{owner_name('key-a')}~old" not in server.store.records
        assert {"old", unnamed["conversation"]} <= set(server.store.records)
    assert all((tmp_path / "conversations" / name).read_bytes() == data for name, data in files.items())


def test_keys_from_the_command_line_a_file_and_the_environment(model_dir, tmp_path, monkeypatch):
    from h2o_stream.cli.serve import serve

    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# the team's keys\n\n  file-key-1  \nfile-key-2\n")
    monkeypatch.setenv("H2O_STREAM_API_KEY", "env-key")
    assert serve.make_context("serve", []).params["api_key"] == ("env-key",)
    given = serve.make_context("serve", ["--api-key", "k1", "--api-key", "k2", "--api-keys-file", str(keys_file)])
    assert given.params["api_key"] == ("k1", "k2")
    assert given.params["api_keys_file"] == ("file-key-1", "file-key-2")

    state = tmp_path / "state"
    state.mkdir()
    process, url = serve_process(model_dir, state, "--api-key", "cli-key", "--api-keys-file", str(keys_file))
    try:
        for key in ("cli-key", "file-key-1", "file-key-2"):
            client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
            assert [m.id for m in client.models.list()] == [MODEL]
        for key in ("env-key", "# the team's keys", "file-key"):  # the environment's key is not taken beside --api-key
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60).models.list()
    finally:
        process.terminate()
        process.wait(timeout=60)
