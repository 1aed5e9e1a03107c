"""Faults of `h2o-stream serve`: SIGKILL during a streamed reply (and mid-save) then a restart, a full disk while a
turn is saved, damaged and crafted session files, an unreadable index, and a second server on the same state."""

from __future__ import annotations

import errno
import os
import signal
import time

import openai
import pytest

import h2o_stream.files
from h2o_stream.apps.chat.session_file import SESSION_FORMAT, SESSION_VERSION
from h2o_stream.errors import H2OStreamError
from h2o_stream.files import WRITE_DELAY_ENV, read_verified
from support.crafted_files import crafted_body, with_header  # a file that runs code if unpickled unsafely
from support.serve_helpers import GREEDY, MODEL, conversation, extra, reply_of, serve_process, served

TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.", "user assistant system"]


def _talk(client, turns, message, **kwargs):
    response = client.chat.completions.create(model=MODEL, messages=conversation(turns, message), **GREEDY, **kwargs)
    return reply_of(response), extra(response)


def test_sigkill_during_a_streamed_reply_then_restart_every_conversation_continues(
    model, tokenizer, model_dir, tmp_path
):
    histories, seen = {}, {}
    with served(model, tokenizer, tmp_path) as server:
        client = server.client()
        for k in range(3):
            turns = []
            for i in range(2):
                text, info = _talk(client, turns, f"conversation {k} turn {i}", extra_body={"seed": k})
                turns.append((f"conversation {k} turn {i}", text))
            histories[k], seen[k] = turns, info["tokens_seen"]

    # a server whose every save pauses halfway through the file: killed there, during a streamed reply
    process, url = serve_process(model_dir, tmp_path, env={WRITE_DELAY_ENV: "60"})
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model=MODEL, messages=conversation(histories[0], "one more"), stream=True, temperature=0, max_tokens=4
        )
        received = []
        for chunk in stream:  # the reply's text arrives; its last chunk would follow the save
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
                break
        partial = []
        for _ in range(600):
            partial = [p for p in (tmp_path / "conversations").iterdir() if ".tmp" in p.name]
            if partial:
                break
            time.sleep(0.05)
        assert received and partial  # killed during the reply, with a session file half-written
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    with served(model, tokenizer, tmp_path) as server:
        assert not [p for p in server.store.dir.iterdir() if ".tmp" in p.name]  # the partial file is gone
        client = server.client()
        for k in range(3):
            _, info = _talk(client, histories[k], "after the restart")
            assert info["how"] == "continued" and info["reused_turns"] == 2 and info["replayed_turns"] == 0
            assert info["tokens_seen"] - info["fed_tokens"] - seen[k] <= GREEDY["max_tokens"]
        assert len(server.store.records) == 3


def test_sigterm_stops_the_server_cleanly_and_its_conversations_are_kept(model_dir, tmp_path):
    """SIGTERM (what a service manager sends) ends `h2o-stream serve` after a graceful shutdown: the turn it saved is
    kept whole, and the process ends by the signal (uvicorn raises it again once shut down, so the exit says why)."""
    process, url = serve_process(model_dir, tmp_path)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        text, info = _talk(client, [], "hello")
        assert info["how"] == "new"
    finally:
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=60)
    assert status == -signal.SIGTERM
    saved = list((tmp_path / "conversations").iterdir())
    assert saved and not [p for p in saved if ".tmp" in p.name]


def _fail_writes(monkeypatch):
    def full_disk(file, body):
        file.write(body[: len(body) // 3])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(h2o_stream.files, "_write_body", full_disk)


def test_a_full_disk_while_saving_keeps_the_last_good_file(model, tokenizer, tmp_path, monkeypatch):
    with served(model, tokenizer, tmp_path) as server:
        client = server.client()
        text, info = _talk(client, [], "hello")
        turns = [("hello", text)]
        record = server.store.records[info["conversation"]]
        good = server.store.path(record.file).read_bytes()
        with monkeypatch.context() as patched:
            _fail_writes(patched)
            with pytest.raises(openai.APIStatusError) as refused:
                _talk(client, turns, "and now?")
            assert refused.value.status_code == 507
            assert "No space left on device" in refused.value.message
            assert "stays at its last completed turn" in refused.value.message
            with pytest.raises(openai.APIError, match="No space left on device"):  # streamed: an error event
                list(
                    client.chat.completions.create(
                        model=MODEL, messages=conversation(turns, "and now?"), stream=True, **GREEDY
                    )
                )
        assert server.store.records[info["conversation"]] is record
        assert server.store.path(record.file).read_bytes() == good  # the last good file, untouched
        read_verified(server.store.path(record.file), SESSION_FORMAT, SESSION_VERSION)
        assert sorted(p.name for p in server.store.dir.iterdir()) == sorted([record.file, f"{record.id}.json"])
        _, info = _talk(client, turns, "and now?")  # room again: the conversation goes on from its last turn
        assert info["how"] == "continued" and info["reused_turns"] == 1


@pytest.mark.parametrize("damage", ["flipped byte", "crafted"])
def test_a_damaged_or_crafted_session_file_is_refused_reported_and_never_run(
    model, tokenizer, tmp_path, caplog, damage
):
    marker = tmp_path / "marker"
    with served(model, tokenizer, tmp_path / "state", in_memory=1) as server:
        client = server.client()
        turns = []
        for message in ("hello", "two plus two"):
            text, info = _talk(client, turns, message)
            turns.append((message, text))
        _talk(client, [], "another conversation")  # the first one leaves memory
        record = server.store.records[info["conversation"]]
        path = server.store.path(record.file)
        if damage == "crafted":
            path.write_bytes(with_header(crafted_body(marker), SESSION_FORMAT, SESSION_VERSION))
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        with caplog.at_level("WARNING", logger="h2o_stream.serve"):
            text, info = _talk(client, turns, "and then?")
        assert not marker.exists()
        assert len(info["notices"]) == 1 and f"refused {record.file}" in info["notices"][0]
        assert ("plain data" if damage == "crafted" else "checksum") in info["notices"][0]
        assert f"refused {record.file}" in caplog.text
        assert path.with_name(path.name + ".corrupt").exists() and not path.exists()
        # rebuilt from the turn before (its file is intact) and the client's history
        assert info["how"] == "continued" and info["reused_turns"] == 1 and info["replayed_turns"] == 1


def test_an_unreadable_index_is_reported_and_a_second_server_is_refused(model, tokenizer, tmp_path, caplog):
    with served(model, tokenizer, tmp_path) as server:
        _, info = _talk(server.client(), [], "hello")
    index = tmp_path / "conversations" / f"{info['conversation']}.json"
    index.write_text("{ not json")
    with caplog.at_level("WARNING", logger="h2o_stream.serve"), served(model, tokenizer, tmp_path) as server:
        assert server.store.records == {}
        assert "the index cannot be read" in caplog.text
        assert index.with_name(index.name + ".corrupt").exists()
        with (
            pytest.raises(H2OStreamError, match="in use by another h2o-stream serve"),
            served(model, tokenizer, tmp_path),
        ):
            pass
        _, again = _talk(server.client(), [], "hello")  # served anew, from the client's history
        assert again["how"] == "new"


def test_conversations_of_another_model_are_not_matched_and_their_files_are_kept(model, tokenizer, tmp_path):
    from support.tiny_models import tiny_llama

    with served(model, tokenizer, tmp_path) as server:
        text, info = _talk(server.client(), [], "hello")
    files = {p.name: p.read_bytes() for p in (tmp_path / "conversations").iterdir()}
    with served(tiny_llama(len(tokenizer), seed=1), tokenizer, tmp_path) as server:
        _, other = _talk(server.client(), [("hello", text)], "and now?")
        assert other["how"] == "new" and other["replayed_turns"] == 1 and other["notices"] == []
    assert all((tmp_path / "conversations" / name).read_bytes() == data for name, data in files.items())
    with served(model, tokenizer, tmp_path) as server:  # the first model again: its conversation is there
        _, again = _talk(server.client(), [("hello", text)], "and now?")
        assert again["how"] == "continued" and again["conversation"] == info["conversation"]


@pytest.mark.parametrize("host", ["127.0.0.1", "no-such-host.invalid"], ids=["busy-port", "bad-host"])
def test_a_busy_port_or_a_bad_host_is_refused_before_the_model_loads_leaving_nothing(tmp_path, capsys, host):
    import socket

    from support.ppl_helpers import command

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        state = tmp_path / "state"
        # a model that would fail to load: the port's error shows that the socket came first
        code, _, stderr = command(
            capsys, "serve", "--model", tmp_path / "no-such-model", "--host", host, "--port", port, "--state-dir", state
        )
    last = stderr.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"Error: cannot listen on {host}:{port}"), stderr
    assert "Traceback" not in stderr and "loading " not in stderr
    assert not state.exists()
