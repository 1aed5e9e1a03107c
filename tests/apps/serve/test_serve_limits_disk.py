"""What `h2o-stream serve` keeps on disk: --max-conversations and --max-disk remove the least recently used
conversations (never a busy one, never the one just saved), --expire-after those unused too long (at start and after
a turn, against the worker's clock), DELETE /v1/conversations/{id} removes one, /health reports the directory's size
as the store counts it, and bad values of the options are refused before the model loads."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from h2o_stream.apps.serve.store import Bounds, Record, to_remove
from h2o_stream.cli.serve import DURATION_UNITS, SIZE_UNITS, amount
from support.serve_helpers import GREEDY, MODEL, conversation, extra, health, on_disk, reply_of, served

TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.", "user assistant system"]


def _talk(client, turns, message, **kwargs):
    response = client.chat.completions.create(model=MODEL, messages=conversation(turns, message), **GREEDY, **kwargs)
    return reply_of(response), extra(response)


def _files_of(state_dir, cid: str) -> list[str]:
    return [name for name in on_disk(state_dir) if name.split(".")[0] == cid]


def _record(cid: str, updated: float) -> Record:
    return Record(cid, root="r", turns=1, head="h", file=f"{cid}.1.session", generation=1, updated=updated)


def test_to_remove_takes_the_expired_then_the_least_recently_used_until_the_bounds_hold():
    records = [_record(name, updated) for name, updated in (("c", 30.0), ("a", 10.0), ("b", 20.0), ("d", 40.0))]
    sizes = {"a": 100, "b": 100, "c": 100, "d": 100, "busy": 100}  # "busy" counts but may not go
    assert to_remove(records, sizes, Bounds(), now=1000.0) == []
    assert [r.id for r in to_remove(records, sizes, Bounds(max_conversations=3), 1000.0)] == ["a", "b"]
    assert [r.id for r in to_remove(records, sizes, Bounds(max_bytes=250), 1000.0)] == ["a", "b", "c"]
    assert [r.id for r in to_remove(records, sizes, Bounds(expire_after=975), 1000.0)] == ["a", "b"]
    # more to remove than may go: all of them, and no more
    assert [r.id for r in to_remove(records, sizes, Bounds(max_bytes=1), 1000.0)] == ["a", "b", "c", "d"]


def test_max_conversations_removes_the_least_recently_used_with_its_files(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path, bounds=Bounds(max_conversations=2)) as server:
        client = server.client()
        first, info = _talk(client, [], "conversation zero")
        zero = info["conversation"]
        _, one = _talk(client, [], "conversation one")
        _, info = _talk(client, [("conversation zero", first)], "zero again")  # zero is now used after one
        assert info["conversation"] == zero and info["how"] == "continued"
        assert set(server.store.records) == {zero, one["conversation"]}
        _, two = _talk(client, [], "conversation two")
        assert set(server.store.records) == {zero, two["conversation"]}
        assert _files_of(tmp_path, one["conversation"]) == []  # index and session files gone
        state = health(server)
        assert state["conversations"] == 2 and state["state_bytes"] == sum(on_disk(tmp_path).values())


def test_max_disk_keeps_the_newest_that_fit_and_saves_one_larger_than_the_bound_alone(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path) as server:
        ids = [_talk(server.client(), [], f"conversation {k}")[1]["conversation"] for k in range(3)]
        sizes = dict(server.store.sizes)
    bound = sizes[ids[1]] + sizes[ids[2]] + sizes[ids[0]] // 2
    with served(model, tokenizer, tmp_path, bounds=Bounds(max_bytes=bound)) as server:
        assert set(server.store.records) == {ids[1], ids[2]}  # over the bound at start: the oldest went
        _, info = _talk(server.client(), [], "conversation 3")
        assert set(server.store.records) == {ids[2], info["conversation"]}
        assert sum(server.store.sizes.values()) <= bound
        assert server.store.bytes == sum(on_disk(tmp_path).values())
    with served(model, tokenizer, tmp_path, bounds=Bounds(max_bytes=1)) as server:
        assert server.store.records == {} and on_disk(tmp_path) == {}
        _, alone = _talk(server.client(), [], "larger than the bound")
        assert list(server.store.records) == [alone["conversation"]]  # saved all the same
        assert server.store.bytes > 1
        _, next_one = _talk(server.client(), [], "and another")
        assert list(server.store.records) == [next_one["conversation"]]


def test_expire_after_removes_the_unused_at_start_and_after_a_turn(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path) as server:
        old = _talk(server.client(), [], "an old conversation")[1]["conversation"]
        recent = _talk(server.client(), [], "a recent one")[1]["conversation"]
    index = tmp_path / "conversations" / f"{old}.json"
    data = json.loads(index.read_text())
    index.write_text(json.dumps({**data, "updated": data["updated"] - 2 * 3600}))  # last used two hours ago
    with served(model, tokenizer, tmp_path, bounds=Bounds(expire_after=3600)) as server:
        assert list(server.store.records) == [recent] and _files_of(tmp_path, old) == []
        conversations = server.service.worker.conversations
        conversations.clock = lambda: time.time() + 2 * 3600  # two hours on: the recent one is unused that long
        _, info = _talk(server.client(), [], "a new one")
        assert list(server.store.records) == [info["conversation"]] and _files_of(tmp_path, recent) == []


def test_delete_removes_a_conversation_and_refuses_an_unknown_or_busy_one(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path) as server:
        client = server.client()
        header = {"X-Conversation-Id": "mine"}
        turns = []
        for message in ("hello", "two plus two"):
            text, _ = _talk(client, turns, message, extra_headers=header)
            turns.append((message, text))
        _talk(client, [], "someone else")
        worker = server.service.worker
        assert "mine" in worker.conversations.sessions and _files_of(tmp_path, "mine")

        deleted = client.conversations.delete("mine")
        assert (deleted.id, deleted.object, deleted.deleted) == ("mine", "conversation.deleted", True)
        assert "mine" not in server.store.records and "mine" not in worker.conversations.sessions
        assert _files_of(tmp_path, "mine") == []
        state = health(server)
        assert state["conversations"] == 1 and state["state_bytes"] == sum(on_disk(tmp_path).values())

        for missing in ("mine", "never-was", "a~b"):
            with pytest.raises(openai.NotFoundError) as refused:
                client.conversations.delete(missing)
            assert refused.value.body["code"] == "conversation_not_found"
            assert refused.value.body["type"] == "invalid_request_error"
        # its name is free: the same id and history start it anew, every exchange fed again
        _, info = _talk(client, turns, "and then?", extra_headers=header)
        assert info["how"] == "new" and info["replayed_turns"] == 2 and info["conversation"] == "mine"

        busy = {"X-Conversation-Id": "busy-one"}
        text, _ = _talk(client, [], "hello", extra_headers=busy)
        stream = client.chat.completions.create(  # a reply of a few hundred tokens, greedy
            model=MODEL,
            messages=conversation([("hello", text)], "go on"),
            temperature=0,
            max_tokens=4000,
            stream=True,
            extra_headers=busy,
        )
        next(iter(stream))  # a turn of "busy-one" is under way
        with pytest.raises(openai.ConflictError) as refused:
            client.conversations.delete("busy-one")
        assert refused.value.body["code"] == "conversation_busy"
        stream.close()
        for _ in range(200):  # the worker lets the cancelled turn go at its next step
            if "busy-one" not in worker.conversations.busy:
                break
            threading.Event().wait(0.05)
        assert client.conversations.delete("busy-one").deleted and "busy-one" not in server.store.records


def test_a_busy_conversation_is_not_removed_to_make_room(model, tokenizer, tmp_path):
    with served(model, tokenizer, tmp_path, bounds=Bounds(max_conversations=1)) as server:
        client = server.client()
        text, info = _talk(client, [], "hello")
        long = info["conversation"]
        stream = client.chat.completions.create(
            model=MODEL, messages=conversation([("hello", text)], "go on"), temperature=0, max_tokens=4000, stream=True
        )
        next(iter(stream))  # under way: its conversation is busy
        _, other = _talk(client, [], "another")
        assert set(server.store.records) == {long, other["conversation"]}
        stream.close()


def test_health_needs_no_key_and_counts_the_directory_as_found(model, tokenizer, tmp_path):
    (tmp_path / "conversations").mkdir()
    (tmp_path / "conversations" / "x.1.session.corrupt").write_bytes(b"x" * 100)  # set aside earlier: counted
    with served(model, tokenizer, tmp_path, api_keys=("k",)) as server:
        assert health(server) == {
            "status": "ok",
            "model": MODEL,
            "conversations": 0,
            "in_memory": 0,
            "state_bytes": 100,
        }
        _talk(server.client(api_key="k"), [], "hello")
        state = health(server)
        assert state["conversations"] == 1 and state["in_memory"] == 1
        assert state["state_bytes"] == sum(on_disk(tmp_path).values()) > 100


def test_sizes_and_durations_read_as_bytes_and_seconds():
    assert amount("500MB", "--max-disk", SIZE_UNITS, "") == 500 * 10**6
    assert amount("2GiB", "--max-disk", SIZE_UNITS, "") == 2 * 2**30
    assert amount("1.5 kb", "--max-disk", SIZE_UNITS, "") == 1500
    assert amount("4096", "--max-disk", SIZE_UNITS, "") == 4096
    assert amount("none", "--max-disk", SIZE_UNITS, "") is None
    assert amount("30m", "--expire-after", DURATION_UNITS, "") == 1800
    assert amount("7d", "--expire-after", DURATION_UNITS, "") == 7 * 86400
    assert amount(None, "--expire-after", DURATION_UNITS, "") is None


@pytest.mark.parametrize(
    "option, value, says",
    [
        (
            "--max-disk",
            "lots",
            "--max-disk must be a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 500MB",
        ),
        ("--max-disk", "2XB", "got '2XB'"),
        ("--max-disk", "0", "--max-disk must be more than 0 (or 'none' for no limit)"),
        ("--expire-after", "10", "--expire-after must be a number and a unit (s, m, h, d, w), e.g. 30m"),
        ("--expire-after", "3y", "got '3y'"),
        ("--max-conversations", "0", "--max-conversations"),
        ("--api-keys-file", "missing", "cannot read --api-keys-file"),
        ("--api-keys-file", "comments-only", "holds no key"),
        ("--api-keys-file", "a-directory", "cannot read --api-keys-file"),
    ],
)
def test_bad_bounds_and_key_files_are_refused_before_the_model_loads(tmp_path, capsys, option, value, says):
    from support.ppl_helpers import command

    (tmp_path / "comments-only").write_text("# no keys yet\n\n   \n")
    (tmp_path / "a-directory").mkdir()
    state = tmp_path / "state"
    if option == "--api-keys-file":
        value = str(tmp_path / value)
    code, _, stderr = command(
        capsys, "serve", "--model", tmp_path / "no-such-model", "--state-dir", state, option, value
    )
    last = stderr.strip().splitlines()[-1]
    assert code == 2 and last.startswith("Error: ") and says in last, stderr
    assert "Traceback" not in stderr and "loading " not in stderr
    assert not state.exists()


def test_the_start_line_says_how_many_conversations_the_directory_holds_and_its_size(
    model, tokenizer, model_dir, tmp_path, capsys, monkeypatch
):
    import h2o_stream.apps.serve.app as app
    from support.ppl_helpers import command

    with served(model, tokenizer, tmp_path) as server:
        _talk(server.client(), [], "hello")
        size = server.store.bytes

    def started(service, host, port, *, on_ready, sock, **options):  # the start line, then stop instead of serving
        on_ready("http://127.0.0.1:1/v1")
        sock.close()
        service.stop()

    monkeypatch.setattr(app, "run", started)
    args = ["--model", model_dir, "--model-name", MODEL, "--state-dir", tmp_path, "--port", "0", "--max-disk", "1GiB"]
    code, _, stderr = command(capsys, "serve", *args, "--api-key", "a", "--api-key", "b", "--log-level", "warning")
    assert code == 0, stderr
    line = next(line for line in stderr.splitlines() if line.startswith("serving "))
    assert f"| conversations in {tmp_path}: 1 ({size / 2**20:.1f} MiB on disk, at most 1024.0 MiB)," in line
    assert line.endswith("| API key required (2 keys taken)")
