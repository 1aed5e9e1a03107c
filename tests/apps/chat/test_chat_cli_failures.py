"""`h2o-stream chat` when things go wrong around it: a save that fails, stdout on a full disk, stdin that is not
text, a loaded session with other settings, a system prompt longer than the cache, a Ctrl-C outside a reply."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from h2o_stream import H2OStreamError
from h2o_stream.cli.chat import chat
from h2o_stream.cli.repl import Repl
from support.chat_helpers import ONE_THREAD, TRAINING_TEXTS, main_command, session_for  # noqa: F401
from support.ppl_helpers import unmeasured
from support.read_only import read_only_directory


def run_chat(args, stdin, monkeypatch):
    monkeypatch.setenv("H2O_STREAM_CHAT_HISTORY", "")
    return CliRunner().invoke(chat, [str(a) for a in args], input=stdin)


def run_process(args, stdin: bytes, **kwargs):
    return subprocess.run(
        main_command(*args),
        input=stdin,
        capture_output="stdout" not in kwargs,
        env=kwargs.pop("env", {**ONE_THREAD, "PYTHONDONTWRITEBYTECODE": "1"}),
        timeout=120,
        **kwargs,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


# -- a save that fails leaves the session alive ------------------------------------------------------------------------


def test_a_save_that_fills_the_disk_says_so_and_the_chat_goes_on(model_dir, tmp_path):
    """A real write failure from the kernel: the file size limit (EFBIG; a full disk gives ENOSPC) is hit in the
    middle of writing a cache tensor. torch's writer raised a RuntimeError there ("unexpected pos"), which ended the
    chat and lost the conversation."""

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))

    long_message = "hello world " * 120  # a cache tensor of more than 16 KiB
    stdin = f"{long_message}\n/save {tmp_path}/big.pt\n/stats\nworld\n".encode()
    result = run_process(
        ["--model", model_dir, "--max-new-tokens", 3, "--temperature", 0],
        stdin,
        preexec_fn=small_files,
        env=unmeasured({**ONE_THREAD, "PYTHONDONTWRITEBYTECODE": "1"}),
    )
    out, err = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 1, err  # piped, and one command failed
    assert "Traceback" not in err
    assert error_lines(err) == [f"Error: cannot save the session to {tmp_path}/big.pt: File too large"]
    assert "turns:           1" in out  # /stats after the failed save: the session is alive
    assert err.count("[reply cut at --max-new-tokens 3]") == 2  # and the next message got its reply
    assert list(tmp_path.iterdir()) == []  # no partial file left behind


def test_a_save_to_a_read_only_place_says_why_and_the_chat_goes_on(model_dir, tmp_path, monkeypatch):
    """The file system refuses the save and also the clean-up of the partial file (EROFS): the clean-up's error
    used to replace the save's and end the chat. (Injected: a real read-only mount needs privileges.)"""

    def read_only(call):
        def refuse(*args, **kwargs):
            if "ro" in Path(args[-1]).name.split("."):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS))
            return call(*args, **kwargs)

        return refuse

    monkeypatch.setattr(os, "replace", read_only(os.replace))
    monkeypatch.setattr(os, "unlink", read_only(os.unlink))
    stdin = f"hello\n/save {tmp_path}/ro.pt\nworld\n/save {tmp_path}/rw.pt\n/stats\n"
    result = run_chat(["--model", model_dir, "--max-new-tokens", 3, "--temperature", 0], stdin, monkeypatch)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    assert error_lines(result.stderr) == [f"Error: cannot save the session to {tmp_path}/ro.pt: Read-only file system"]
    assert "saved the session (turn 2" in result.stdout and "turns:           2" in result.stdout
    assert (tmp_path / "rw.pt").is_file() and not (tmp_path / "ro.pt").exists()


def test_a_save_into_a_read_only_directory_says_why(model_dir, tmp_path, monkeypatch):
    locked, reason = read_only_directory(tmp_path)  # one that refuses root too: the tests run as root in CI
    result = run_chat(
        ["--model", model_dir, "--max-new-tokens", 3], f"hello\n/save {locked}/s.pt\n/stats\n", monkeypatch
    )
    assert result.exit_code == 1 and "turns:           1" in result.stdout
    assert error_lines(result.stderr) == [f"Error: cannot save the session to {locked}/s.pt: {reason}"]
    assert not (locked / "s.pt").exists()


def test_any_failing_command_leaves_the_session_alive(model, tokenizer, monkeypatch, capsys):
    session = session_for(model, tokenizer)
    monkeypatch.setattr(session, "save", lambda path: (_ for _ in ()).throw(RuntimeError("disk on fire")))
    repl = Repl(session, interactive=False)
    assert repl.command("/save x.pt") is True  # the REPL goes on
    assert repl.failures == 1
    assert "Error: /save failed: RuntimeError: disk on fire (the session is as it was)" in capsys.readouterr().err


# -- stdout that cannot take the output --------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_stdout_on_a_full_device_is_one_error_line(model_dir):
    with open("/dev/full", "wb") as full:
        result = run_process(
            ["--model", model_dir, "--max-new-tokens", 3],
            b"hello\n/stats\nworld\n",
            stdout=full,
            stderr=subprocess.PIPE,
        )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert error_lines(err) == ["Error: cannot write to stdout (No space left on device); the chat stops here"]
    assert err.rstrip().endswith("the chat stops here")


# -- stdin that is not text --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, message",
    [
        (
            b"caf\xe9 au lait",
            "Error: stdin line 2 is not UTF-8 text (byte 0xe9 at offset 3): chat reads one message per line of text",
        ),
        (
            b"\x7fELF\x02\x01\x00\x00",
            "Error: stdin line 2 is not text (it holds a NUL byte): chat reads one message per line of text",
        ),
    ],
)
def test_a_binary_line_on_stdin_is_one_error_line_and_exit_2(model_dir, line, message):
    result = run_process(
        ["--model", model_dir, "--max-new-tokens", 3, "--temperature", 0], b"hello\n" + line + b"\nnever sent\n"
    )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "Traceback" not in err
    assert error_lines(err) == [message] and err.rstrip().endswith(message)
    assert err.count("[reply cut at --max-new-tokens 3]") == 1  # the line before it was answered, none after


def test_a_message_that_is_not_valid_text_is_refused_and_changes_nothing(model, tokenizer):
    """What a terminal in the C locale hands over for bytes that are not UTF-8 (surrogateescape): the tokenizer
    raised a TypeError on it."""
    session = session_for(model, tokenizer)
    session.chat("hello")
    with pytest.raises(H2OStreamError, match=r"the message is not valid text \(character 3 is not UTF-8"):
        session.chat("caf\udce9 au lait")
    assert session.turns == 1
    assert session.chat("world").stop_reason in ("end", "length")


# -- settings a loaded session brings along, a system prompt longer than the cache -------------------------------------


def test_loading_a_session_with_another_cache_names_both(model_dir, tmp_path, monkeypatch):
    path = tmp_path / "sink.pt"
    saved = run_chat(
        ["--model", model_dir, "--policy", "sink", "--cache-size", 16, "--max-new-tokens", 2],
        f"hello\n/save {path}\n",
        monkeypatch,
    )
    assert saved.exit_code == 0, saved.output
    notice = (
        "note: the loaded session keeps its own cache, sink(sinks=4, recent=12), instead of this chat's "
        "h2o(heavy=16, recent=16) (--cache-size does not apply: a saved session's cache cannot change)"
    )
    on_the_command_line = run_chat(
        ["--model", model_dir, "--cache-size", 32, "--max-new-tokens", 2, "--load", path], "/stats\n", monkeypatch
    )
    assert on_the_command_line.exit_code == 0, on_the_command_line.output
    assert notice in on_the_command_line.stderr and "16/16" in on_the_command_line.stdout
    in_the_chat = run_chat(
        ["--model", model_dir, "--cache-size", 32, "--max-new-tokens", 2], f"/load {path}\n", monkeypatch
    )
    assert in_the_chat.exit_code == 0 and notice in in_the_chat.stderr
    same = run_chat(
        ["--model", model_dir, "--policy", "sink", "--cache-size", 16, "--max-new-tokens", 2],
        f"/load {path}\n",
        monkeypatch,
    )
    assert same.exit_code == 0 and "resumed the session" in same.stdout and "note: the loaded" not in same.stderr


def test_a_system_prompt_longer_than_the_cache_is_warned_about(model_dir, monkeypatch):
    long = "You are a helpful AI assistant named SmolLM, trained by Hugging Face. " * 4
    result = run_chat(
        ["--model", model_dir, "--cache-size", 16, "--max-new-tokens", 2, "--system", long], "hello\n", monkeypatch
    )
    assert result.exit_code == 0, result.output
    assert "warning: the system prompt is " in result.stderr
    assert "tokens, more than the cache holds (16 entries): the model cannot see all of it" in result.stderr
    short = run_chat(
        ["--model", model_dir, "--cache-size", 16, "--max-new-tokens", 2, "--system", "Be brief."],
        "hello\n",
        monkeypatch,
    )
    assert short.exit_code == 0 and "warning" not in short.stderr


# -- Ctrl-C outside a reply --------------------------------------------------------------------------------------------


def test_ctrl_c_ends_only_a_read_and_stops_only_a_reply(model, tokenizer):
    """The REPL's SIGINT handler: a KeyboardInterrupt only while a line is read (the prompt gets a fresh one);
    anywhere else (a command, between a reply and the prompt) it only asks a reply to stop, so no Ctrl-C ends the
    session."""
    repl = Repl(session_for(model, tokenizer), interactive=True)
    repl._on_interrupt(signal.SIGINT, None)  # not reading: no exception
    assert repl._stop.is_set()
    repl._waiting = True
    with pytest.raises(KeyboardInterrupt):
        repl._on_interrupt(signal.SIGINT, None)
    repl._on_interrupt(signal.SIGINT, None)  # a second Ctrl-C while the first is handled: no second exception
