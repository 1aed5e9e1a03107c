"""`h2o-stream chat` in a terminal (pexpect): streaming, Ctrl-C, Ctrl-D; and the real default model end to end."""

from __future__ import annotations

import ctypes
import io
import os
import re
import signal
import sys
import time

import pytest

from support.chat_helpers import ONE_THREAD, TRAINING_TEXTS, main_command, real_model_available  # noqa: F401


@pytest.mark.parametrize(
    "setting, written",
    [(None, "cache/chat_history"), ("mine/history", "mine/history"), ("", None)],
    ids=["default", "H2O_STREAM_CHAT_HISTORY", "off"],
)
def test_a_terminal_chat_keeps_its_history_in_the_cache_directory_unless_told_otherwise(
    setting, written, tmp_path, monkeypatch
):
    pytest.importorskip("readline")
    from h2o_stream.cli.repl import Repl

    monkeypatch.setenv("H2O_STREAM_CACHE", str(tmp_path / "cache"))
    if setting is None:
        monkeypatch.delenv("H2O_STREAM_CHAT_HISTORY", raising=False)
    else:
        monkeypatch.setenv("H2O_STREAM_CHAT_HISTORY", str(tmp_path / setting) if setting else "")

    def ctrl_d(prompt):
        raise EOFError

    monkeypatch.setattr("builtins.input", ctrl_d)
    assert list(Repl(None, interactive=True, out=io.StringIO()).lines()) == []
    files = sorted(path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*") if path.is_file())
    assert files == ([written] if written else [])


def spawn(args, timeout=120):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable, main_command(*args)[1:], env=ONE_THREAD, encoding="utf-8", timeout=timeout, dimensions=(40, 200)
    )
    return child


def pexpect_eof():
    import pexpect

    return pexpect.EOF


def test_terminal_ctrl_c_stops_a_reply_and_ctrl_d_exits(model_dir):
    child = spawn(["--model", model_dir, "--max-new-tokens", 100000, "--temperature", 0])
    try:
        child.expect_exact(">>> ")
        child.sendline("hello world")
        child.expect_exact("hello world\r\n")
        child.expect(r"\S")  # the reply is streaming
        time.sleep(0.5)
        child.sendintr()
        child.expect_exact("[stopped after")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"turns:\s+1")
        child.expect_exact(">>> ")
        child.sendintr()  # at the prompt: a new prompt, nothing else
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_a_ctrl_c_that_misses_the_prompts_wait_still_gives_a_fresh_prompt(model_dir):
    """The race behind a once-missing fresh prompt, made certain: the SIGINT is taken by another thread of the chat
    process, so CPython's C-level handler runs there and readline's select() in the main thread is not interrupted,
    just as when a Ctrl-C lands right before that select() (under load). A fresh prompt must still come at once, and
    the session go on."""
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if tgkill is None or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux's tgkill and /proc")
    child = spawn(["--model", model_dir, "--max-new-tokens", 3, "--temperature", 0])
    try:
        child.expect_exact(">>> ")
        time.sleep(0.5)  # the main thread is waiting in readline now
        others = [int(t) for t in os.listdir(f"/proc/{child.pid}/task") if int(t) != child.pid]
        if not others:
            pytest.skip("the chat process has no second thread")
        assert tgkill(child.pid, others[0], signal.SIGINT) == 0
        child.expect_exact("(Ctrl-C stops a reply", timeout=10)
        child.expect_exact(">>> ", timeout=10)
        child.sendline("hello world")
        child.expect_exact("[reply cut at --max-new-tokens 3]")
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def read_reply(child, prompt=">>> "):
    """Everything up to the next prompt, as the chunks it arrived in."""
    chunks, text = [], ""
    deadline = time.monotonic() + 120
    while not text.endswith(prompt):
        if time.monotonic() > deadline:
            raise AssertionError(f"no prompt after: {text!r}")
        try:
            chunk = child.read_nonblocking(4096, timeout=1)
        except Exception as error:
            if type(error).__name__ == "TIMEOUT":
                continue
            raise
        chunks.append((time.monotonic(), chunk))
        text += chunk
    return text[: -len(prompt)], chunks


@pytest.mark.slow
def test_real_model_in_a_terminal_three_turns_stats_save_and_resume_in_a_new_process(tmp_path):
    real_model_available()
    args = ["--temperature", 0, "--max-new-tokens", 24, "--cache-size", 64, "--threads", 1]
    path = tmp_path / "session.pt"
    child = spawn(args, timeout=300)
    try:
        child.expect_exact(">>> ", timeout=300)
        for question in ["What is the capital of France?", "And of Italy?", "Name a famous painter from there."]:
            child.sendline(question)
            child.expect_exact(question + "\r\n")  # the terminal's echo
            reply, chunks = read_reply(child)
            assert re.search(r"[A-Za-z]{2}", reply), reply
            assert len(chunks) > 1 and chunks[-1][0] - chunks[0][0] > 0.05, "the reply did not stream"
        child.sendline("/stats")
        stats, _ = read_reply(child)
        occupancy = re.search(r"cache occupancy: (\d+)/(\d+)", stats)
        assert occupancy and int(occupancy[1]) <= int(occupancy[2]) == 64, stats
        assert re.search(r"turns:\s+3", stats) and re.search(r"evictions:\s+[1-9]", stats), stats
        seen = re.search(r"tokens seen:\s+(\d+)", stats)[1]
        child.sendline(f"/save {path}")
        saved, _ = read_reply(child)
        assert "saved the session (turn 3" in saved
        child.sendline("Tell me one more thing.")
        child.expect_exact("Tell me one more thing.\r\n")
        fourth, _ = read_reply(child)
        child.sendline("/exit")
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

    child = spawn(args, timeout=300)
    try:
        child.expect_exact(">>> ", timeout=300)
        child.sendline(f"/load {path}")
        loaded, _ = read_reply(child)
        assert "resumed the session" in loaded and "3 turn(s)" in loaded and f"{seen} tokens seen" in loaded
        child.sendline("Tell me one more thing.")
        child.expect_exact("Tell me one more thing.\r\n")
        again, _ = read_reply(child)
        assert again == fourth  # greedy: the same session gives the same next reply
        child.sendeof()
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
